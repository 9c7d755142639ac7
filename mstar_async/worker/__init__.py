"""Workers: the continuous-batching loop that runs node steps on a worker's engines."""

from __future__ import annotations

from mstar_async.worker.batching import BatchingLoop, BatchStats

__all__ = ["BatchStats", "BatchingLoop"]
