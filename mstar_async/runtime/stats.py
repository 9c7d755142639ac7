"""``Runtime.stats()``: what every rank runs and holds, and what crossed the conductor.

In process the runtime's own batching loop is rank 0; with worker processes each rank answers
a ping with the same report (``mstar_async.worker.report``), so ``/metrics``, ``/health/ready``
and tests read one shape whichever way the model runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from mstar_async.errors import MstarError
from mstar_async.worker.pool import WorkerPool
from mstar_async.worker.report import loop_report
from mstar_async.worker.walk_loop import WalkLoop

#: A rank that does not answer within this many seconds is reported down: its message loop is
#: blocked, so it serves nothing either. Short, as a readiness probe's own timeout is.
ANSWER_WITHIN_S = 0.5


@dataclass(frozen=True)
class RankStats:
    """One rank now. ``up`` is false while its worker starts, restarts, is down or does not
    answer, and ``reason`` says which; the counters are then zero. ``kv`` holds
    ``(used, total)`` KV blocks per engine with a paged cache, ``batch_sizes`` the number of
    forwards that ran each batch size, ``stalled_s`` how long steps have waited with no forward
    finishing, ``details`` the rank's other counters (tensors held, peer traffic, kept KV)."""

    rank: int
    up: bool
    reason: str = ""
    running: int = 0
    waiting: int = 0
    kv: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    forwards: int = 0
    steps: int = 0
    batch_sizes: Mapping[int, int] = field(default_factory=dict)
    restarts: int = 0
    stalled_s: float = 0.0
    details: Mapping[str, int] = field(default_factory=dict)

    @property
    def kv_used(self) -> int:
        """KV blocks held now, over every engine of the rank."""
        return sum(used for used, _ in self.kv.values())

    @property
    def kv_total(self) -> int:
        """KV blocks the rank's engines have, over every engine of the rank."""
        return sum(total for _, total in self.kv.values())


@dataclass(frozen=True)
class ConductorStats:
    """The conductor: ``requests`` running (their programs); ``step_messages``, messages to or
    from ranks that are neither walk traffic nor the workers' lifecycle (a node step sent on
    its own would be one: walks run their steps on the workers, so 0); ``bytes_received`` of
    the frames ranks sent it; and ``state_bytes``, of those, a request's engine state (a KV
    moves worker to worker, so 0). All zero in process but ``requests``."""

    requests: int = 0
    step_messages: int = 0
    bytes_received: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class RuntimeStats:
    """Every rank (rank 0 alone in process) and the conductor."""

    ranks: Mapping[int, RankStats]
    conductor: ConductorStats = field(default_factory=ConductorStats)

    @property
    def down(self) -> dict[int, str]:
        """The ranks that are not up, each with why."""
        return {rank: s.reason for rank, s in self.ranks.items() if not s.up}


#: The report's fields ``RankStats`` has names for; the rest go to ``details``.
_READ = frozenset({"walks", "waiting", "kv", "forwards", "steps", "batch_sizes", "stalled_ms"})


def rank_stats(rank: int, report: Mapping[str, Any], restarts: int = 0) -> RankStats:
    """A rank's stats from its loop's report (see ``loop_report``). Never raises on a report
    that lacks fields (an older worker): they read as zero."""
    return RankStats(
        rank=rank,
        up=True,
        running=int(report.get("walks", 0)),
        waiting=int(report.get("waiting", 0)),
        kv={name: (int(u), int(t)) for name, (u, t) in report.get("kv", {}).items()},
        forwards=int(report.get("forwards", 0)),
        steps=int(report.get("steps", 0)),
        batch_sizes={int(k): int(v) for k, v in report.get("batch_sizes", {}).items()},
        restarts=restarts,
        stalled_s=report.get("stalled_ms", 0) / 1000,
        details={k: v for k, v in report.items() if k not in _READ and isinstance(v, int)},
    )


def in_process_stats(batching: WalkLoop, requests: int) -> RuntimeStats:
    """Stats of a runtime whose one rank is ``batching``, in this process, with ``requests``
    running. Never raises."""
    return RuntimeStats({0: rank_stats(0, loop_report(batching))}, ConductorStats(requests))


async def pool_stats(
    pool: WorkerPool, requests: int, answer_within_s: float = ANSWER_WITHIN_S
) -> RuntimeStats:
    """Stats of every rank of ``pool``, asked at once, with ``requests`` running; a rank that
    is not ready, or does not answer within ``answer_within_s``, is reported down.
    Cancel-safe; never raises."""
    found: dict[int, RankStats] = {}
    unready = pool.unready_ranks()

    async def ask(rank: int) -> None:
        restarts = pool.ranks[rank].restarts
        if rank in unready:
            found[rank] = RankStats(
                rank, False, f"worker rank {rank} {unready[rank]}", restarts=restarts
            )
            return
        with anyio.move_on_after(answer_within_s):
            try:
                found[rank] = rank_stats(rank, await pool.worker_stats(rank), restarts)
            except MstarError as exc:  # WorkerLost, naming the rank: it died since we looked
                found[rank] = RankStats(rank, False, str(exc), restarts=restarts)
            return
        why = f"worker rank {rank} did not answer within {answer_within_s} s"
        found[rank] = RankStats(rank, False, why, restarts=restarts)

    async with anyio.create_task_group() as tg:
        for rank in pool.ranks:
            tg.start_soon(ask, rank)
    through = pool.stats()
    conductor = ConductorStats(
        requests, through.step_messages, through.bytes_received, through.state_bytes
    )
    return RuntimeStats(dict(sorted(found.items())), conductor)
