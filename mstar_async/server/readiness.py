"""Readiness: whether each served model can make progress now (``GET /health/ready``).

``/health`` answers while the process serves (liveness); readiness asks more: a model is not
ready while one of its ranks is down, starting, restarting or too slow to answer (its message
loop blocked), or while it has steps waiting and no forward has finished for ``stall_after_s``
seconds (a forward that hangs, an engine that never takes its steps). Both are read from
``Runtime.stats()``, the same for a model in this process and one on worker processes.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from mstar_async.runtime import RuntimeStats
from mstar_async.server.served import ServedModel

#: Seconds steps may wait with no forward finishing before a model is reported not ready.
DEFAULT_STALL_SECONDS = 30.0


async def model_stats(models: Mapping[str, ServedModel]) -> dict[str, RuntimeStats]:
    """Every served model's ``Runtime.stats()``, asked at once. Cancel-safe; never raises."""
    found: dict[str, RuntimeStats] = {}

    async def ask(name: str, served: ServedModel) -> None:
        found[name] = await served.runtime.stats()

    async with anyio.create_task_group() as tg:
        for name, served in models.items():
            tg.start_soon(ask, name, served)
    return {name: found[name] for name in models}


def unready_models(stats: Mapping[str, RuntimeStats], stall_after_s: float) -> dict[str, str]:
    """The models whose ``stats`` say they cannot make progress, each with why (empty: all
    are ready). Never raises."""
    found = {name: why_unready(each, stall_after_s) for name, each in stats.items()}
    return {name: why for name, why in found.items() if why is not None}


def why_unready(stats: RuntimeStats, stall_after_s: float) -> str | None:
    """Why a model with these ``stats`` cannot make progress now, or None when it can: every
    rank that is not up, else every rank whose steps have stalled. Never raises."""
    down = stats.down
    if down:
        return "; ".join(down[rank] for rank in sorted(down))
    reasons = [
        f"rank {rank.rank}: {why}"
        for rank in stats.ranks.values()
        if (why := _stalled(rank.stalled_s, stall_after_s)) is not None
    ]
    return "; ".join(reasons) or None


def _stalled(seconds: float, stall_after_s: float) -> str | None:
    if seconds < stall_after_s:
        return None
    return f"steps have waited {seconds:.1f} s with no forward finishing"
