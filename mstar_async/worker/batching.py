"""The continuous-batching loop of one worker.

Node coroutines of many requests submit steps; the loop takes every step that is ready, up to a
token budget per engine, runs one forward per engine off the event-loop thread, and resolves each
step's waiter. Requests join and leave between forwards. A step an engine did not finish (a
chunk of a long prefill, or one that waited for KV memory) goes back to the front of the queue.

The queue is a plain FIFO ``deque``: the oldest step is served first so no request starves;
removal on cancel is rare, so its O(n) cost does not matter.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from mstar_async.engines import WAIT, Engine, Step, StepResult
from mstar_async.errors import EngineError, MstarError
from mstar_async.transport import EXPORT_OP, IMPORT_OP, StepCall


class _Pending:
    __slots__ = ("done", "engine", "error", "outcome", "result", "step", "taken")

    def __init__(self, engine: str, step: Step) -> None:
        self.engine = engine
        self.step = step
        self.done = anyio.Event()
        self.taken = False
        self.outcome: StepResult = None
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None


@dataclass
class BatchStats:
    """What the loop ran: forwards, steps, tokens, and how many forwards had each batch size."""

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
    ``max_batch_tokens`` caps the tokens one forward of an engine processes (decode steps cost
    one; a prefill gets what is left, so decodes are never starved by a long prompt);
    ``max_batch_size`` caps its steps. ``settle_rounds`` is how many scheduler passes the loop
    gives other tasks to submit before it runs a forward.

    Raises:
        ValueError: a limit is below 1.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        max_batch_tokens: int = 512,
        settle_rounds: int = 8,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError(
                f"max_batch_size and max_batch_tokens must be >= 1, got "
                f"{max_batch_size} and {max_batch_tokens}"
            )
        self.engines = dict(engines)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.settle_rounds = settle_rounds
        self.stats = BatchStats()
        self._queue: deque[_Pending] = deque()
        self._parked: list[_Pending] = []  # waiting for KV memory until a request releases
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
        pending = _Pending(call.engine, Step(call.request_id, call.op, call.inputs))
        self._queue.append(pending)
        self._wake.set()
        try:
            await pending.done.wait()
        except BaseException:
            if not pending.taken:
                if pending in self._parked:
                    self._parked.remove(pending)
                else:
                    self._queue.remove(pending)
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    async def release(self, request_id: str) -> None:
        """Tell every engine that ``request_id`` is over (finished, failed or cancelled).

        Runs on the forward thread, after any forward in flight, so engines see no races.
        Shielded from cancellation: a release always completes.
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._release, request_id, limiter=self._limiter)
        if self._parked:
            self._queue.extendleft(reversed(self._parked))
            self._parked.clear()
            self._wake.set()

    def _release(self, request_id: str) -> None:
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
            batches = self._take()
            await anyio.to_thread.run_sync(self._forward_all, batches, limiter=self._limiter)
            self._resolve(batches)

    async def _settle(self) -> None:
        quiet, size = 0, len(self._queue)
        for _ in range(self.settle_rounds):
            await anyio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._queue) == size else 0
            size = len(self._queue)
            if quiet >= 2:
                return

    def _take(self) -> dict[str, list[_Pending]]:
        """Steps for this round, per engine: one-token steps first, then longer ones with the
        tokens left (chunked), each engine within its own token budget."""
        queued: dict[str, list[_Pending]] = {}
        for pending in self._queue:
            queued.setdefault(pending.engine, []).append(pending)
        batches: dict[str, list[_Pending]] = {}
        for name, candidates in queued.items():
            engine = self.engines[name]
            costs = [max(1, engine.cost(p.step)) for p in candidates]
            chosen: list[_Pending] = []
            tokens = 0
            for short in (True, False):
                for pending, cost in zip(candidates, costs, strict=True):
                    if (cost == 1) != short or len(chosen) >= self.max_batch_size:
                        continue
                    grant = min(cost, self.max_batch_tokens - tokens)
                    if grant < 1:
                        break
                    pending.step.budget = grant
                    tokens += grant
                    chosen.append(pending)
            batches[name] = chosen
        for chosen in batches.values():
            for pending in chosen:
                pending.taken = True
                self._queue.remove(pending)
        return batches

    def _forward_all(self, batches: dict[str, list[_Pending]]) -> None:
        for name, group in batches.items():
            if group:
                self._forward_one(name, group)

    def _forward_one(self, name: str, group: list[_Pending]) -> None:
        moves = [p for p in group if p.step.op in (EXPORT_OP, IMPORT_OP)]
        for pending in moves:
            pending.outcome = self._move_state(self.engines[name], pending.step)
        group = [p for p in group if p.step.op not in (EXPORT_OP, IMPORT_OP)]
        if not group:
            return
        self.stats.forwards += 1
        self.stats.steps += len(group)
        self.stats.batch_sizes[len(group)] += 1
        try:
            results = self.engines[name].forward([p.step for p in group])
            if len(results) != len(group):
                raise EngineError(
                    f"engine {name!r} returned {len(results)} results for {len(group)} steps"
                )
        except Exception as exc:
            results = [exc] * len(group)
        for pending, outcome in zip(group, results, strict=True):
            pending.outcome = outcome

    @staticmethod
    def _move_state(engine: Engine, step: Step) -> StepResult:
        """A request's state leaving this engine, or arriving: engines without state move none."""
        try:
            if step.op == EXPORT_OP:
                export = getattr(engine, "export_state", None)
                return {"state": None if export is None else export(step.request_id)}
            import_state = getattr(engine, "import_state", None)
            if import_state is not None:
                import_state(step.request_id, step.inputs.get("state"))
            return {}
        except Exception as exc:
            return exc

    def _resolve(self, batches: dict[str, list[_Pending]]) -> None:
        again: list[_Pending] = []
        for name, group in batches.items():
            stalled = bool(group) and all(p.outcome is WAIT for p in group)
            for pending in group:
                outcome, pending.outcome = pending.outcome, None
                if isinstance(outcome, dict):
                    pending.result = outcome
                elif isinstance(outcome, Exception):
                    pending.error = _engine_error(name, outcome)
                else:
                    pending.taken = False
                    # Nothing at all could run: wait for a release instead of spinning.
                    (self._parked if stalled else again).append(pending)
                    continue
                pending.done.set()
        self._queue.extendleft(reversed(again))


def _engine_error(name: str, exc: Exception) -> BaseException:
    if isinstance(exc, MstarError):
        return exc
    error = EngineError(f"engine {name!r} failed: {exc!r}")
    error.__cause__ = exc
    return error
