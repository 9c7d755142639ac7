"""Workers: the scheduler and the continuous-batching loop that run walks and steps on a
worker's engines."""

from __future__ import annotations

from mstar_async.worker.scheduler import BatchStats, Job, Round, Scheduler
from mstar_async.worker.walk_loop import WalkLoop

__all__ = ["BatchStats", "Job", "Round", "Scheduler", "WalkLoop"]
