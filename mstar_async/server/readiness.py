"""Readiness: whether each served model can make progress now (``GET /health/ready``).

``/health`` answers while the process serves (liveness); readiness asks more: a model is not
ready while one of its worker ranks is down, starting or restarting, or while it has steps
waiting and no forward has finished for ``stall_after_s`` seconds (a forward that hangs, an
engine that never takes its steps). A model in this process is read from its batching loop
(``WalkLoop.stalled_s``); a model on worker processes from its pool (``unready_ranks``) and
from each rank's own loop, asked with a ping that must answer within ``PING_TIMEOUT_S``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import anyio

from mstar_async.errors import MstarError
from mstar_async.server.served import ServedModel

if TYPE_CHECKING:
    from mstar_async.worker.pool import WorkerPool

#: Seconds steps may wait with no forward finishing before a model is reported not ready.
DEFAULT_STALL_SECONDS = 30.0
#: A worker rank that does not answer a ping this fast is reported not ready: its message loop
#: is blocked, so it serves nothing either. Short, as a readiness probe's own timeout is.
PING_TIMEOUT_S = 0.5


async def unready_models(models: Mapping[str, ServedModel], stall_after_s: float) -> dict[str, str]:
    """The served models that are not ready, each with why (empty: all are ready). The models
    are asked at once. Cancel-safe; never raises.
    """
    found: dict[str, str] = {}

    async def ask(name: str, served: ServedModel) -> None:
        why = await why_unready(served, stall_after_s)
        if why is not None:
            found[name] = why

    async with anyio.create_task_group() as tg:
        for name, served in models.items():
            tg.start_soon(ask, name, served)
    return found


async def why_unready(served: ServedModel, stall_after_s: float) -> str | None:
    """Why ``served`` cannot make progress now, or None when it can. Cancel-safe; never
    raises."""
    pool = served.runtime.pool
    if pool is None:
        return _stalled(served.runtime.batching.stalled_s, stall_after_s)
    down = pool.unready_ranks()
    if down:
        return "; ".join(f"worker rank {rank} {why}" for rank, why in sorted(down.items()))
    reasons: dict[int, str] = {}
    async with anyio.create_task_group() as tg:
        for rank in pool.ranks:
            tg.start_soon(_ask_rank, pool, rank, stall_after_s, reasons)
    return "; ".join(reasons[rank] for rank in sorted(reasons)) or None


async def _ask_rank(
    pool: WorkerPool, rank: int, stall_after_s: float, reasons: dict[int, str]
) -> None:
    with anyio.move_on_after(PING_TIMEOUT_S):
        try:
            stats = await pool.worker_stats(rank)
        except MstarError as exc:  # WorkerLost (naming the rank): it died since we looked
            reasons[rank] = str(exc)
            return
        stalled = _stalled(stats.get("stalled_ms", 0) / 1000, stall_after_s)
        if stalled is not None:
            reasons[rank] = f"worker rank {rank}: {stalled}"
        return
    reasons[rank] = f"worker rank {rank} did not answer a ping within {PING_TIMEOUT_S} s"


def _stalled(seconds: float, stall_after_s: float) -> str | None:
    if seconds < stall_after_s:
        return None
    return f"steps have waited {seconds:.1f} s with no forward finishing"
