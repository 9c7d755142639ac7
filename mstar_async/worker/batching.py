"""The continuous-batching loop of one worker.

Node coroutines of many requests submit steps; the loop takes every step that is ready, groups
them by (engine, op), runs each group as one forward off the event-loop thread, and resolves each
step's waiter. Requests join and leave between forwards. The queue is a plain FIFO ``deque``: the
oldest step is served first, so no request starves, and removal on cancel is rare (O(n) is fine).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from mstar_async.engines import Engine
from mstar_async.errors import EngineError, MstarError
from mstar_async.transport import StepCall


class _Pending:
    __slots__ = ("call", "done", "error", "result", "taken")

    def __init__(self, call: StepCall) -> None:
        self.call = call
        self.done = anyio.Event()
        self.taken = False
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None


@dataclass
class BatchStats:
    """Counts of what the loop ran: forwards, steps, and how many forwards had each batch size."""

    forwards: int = 0
    steps: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)

    @property
    def max_batch(self) -> int:
        """The largest batch any forward saw (0 before the first)."""
        return max(self.batch_sizes, default=0)


class BatchingLoop:
    """Runs the steps submitted to one worker's engines in batches.

    Start ``run()`` in a task group; ``submit`` from any task of the same event loop.
    ``max_batch_size`` caps the steps one forward takes; ``settle_rounds`` is how many scheduler
    passes the loop waits for more steps to arrive before it runs a forward (tiny models on a CPU
    finish a forward before other requests have submitted theirs).

    Raises:
        ValueError: ``max_batch_size`` is below 1.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        settle_rounds: int = 8,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engines = dict(engines)
        self.max_batch_size = max_batch_size
        self.settle_rounds = settle_rounds
        self.stats = BatchStats()
        self._queue: deque[_Pending] = deque()
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    async def submit(self, call: StepCall) -> dict[str, Any]:
        """Queue one step and wait for its outputs.

        Cancel-safe: a step cancelled before the loop took it leaves the queue; one already in
        a forward finishes there and its outputs are dropped.

        Raises:
            EngineError: the engine is unknown here, or the forward failed (its cause attached).
        """
        if call.engine not in self.engines:
            raise EngineError(
                f"no engine {call.engine!r} on this worker; engines: {sorted(self.engines)}"
            )
        pending = _Pending(call)
        self._queue.append(pending)
        self._wake.set()
        try:
            await pending.done.wait()
        except BaseException:
            if not pending.taken:
                self._queue.remove(pending)
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def release(self, request_id: str) -> None:
        """Tell every engine that ``request_id`` is over (finished, failed or cancelled)."""
        for engine in self.engines.values():
            engine.release(request_id)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve submitted steps until cancelled.

        Cancel-safe: a forward in flight is allowed to finish (it runs in a thread), then the
        loop stops; steps still queued stay queued for their submitters to be cancelled.
        """
        task_status.started()
        while True:
            if not self._queue:
                self._wake = anyio.Event()
                await self._wake.wait()
            await self._settle()
            batch = self._take()
            await anyio.to_thread.run_sync(self._forward_groups, batch, limiter=self._limiter)
            for pending in batch:
                pending.done.set()

    async def _settle(self) -> None:
        quiet, size = 0, len(self._queue)
        for _ in range(self.settle_rounds):
            await anyio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._queue) == size else 0
            size = len(self._queue)
            if quiet >= 2:
                return

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        while self._queue and len(batch) < self.max_batch_size:
            pending = self._queue.popleft()
            pending.taken = True
            batch.append(pending)
        return batch

    def _forward_groups(self, batch: list[_Pending]) -> None:
        groups: dict[tuple[str, str], list[_Pending]] = {}
        for pending in batch:
            groups.setdefault((pending.call.engine, pending.call.op), []).append(pending)
        for (engine_name, op), group in groups.items():
            self._forward_one(engine_name, op, group)

    def _forward_one(self, engine_name: str, op: str, group: list[_Pending]) -> None:
        self.stats.forwards += 1
        self.stats.steps += len(group)
        self.stats.batch_sizes[len(group)] += 1
        try:
            results = self.engines[engine_name].forward(
                op, [p.call.inputs for p in group], [p.call.request_id for p in group]
            )
            if len(results) != len(group):
                raise EngineError(
                    f"engine {engine_name!r} op {op!r} returned {len(results)} results for "
                    f"{len(group)} steps"
                )
        except MstarError as exc:
            for pending in group:
                pending.error = exc
            return
        except Exception as exc:
            error = EngineError(f"engine {engine_name!r} op {op!r} failed: {exc!r}")
            error.__cause__ = exc
            for pending in group:
                pending.error = error
            return
        for pending, result in zip(group, results, strict=True):
            pending.result = result
