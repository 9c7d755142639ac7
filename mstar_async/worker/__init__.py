"""Workers: the scheduler and continuous-batching loop that run node steps on a worker's
engines."""

from __future__ import annotations

from mstar_async.worker.batching import BatchingLoop
from mstar_async.worker.scheduler import BatchStats, Job, Round, Scheduler

__all__ = ["BatchStats", "BatchingLoop", "Job", "Round", "Scheduler"]
