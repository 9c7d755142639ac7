"""The continuous-batching loop of one worker: an asyncio driver over :class:`Scheduler`.

Node coroutines of many requests submit steps; the loop runs the scheduler's rounds (take the
ready steps within budget, one forward per engine off the event-loop thread, resolve) and wakes
each step's submitter with its outcome. The rules live in ``scheduler.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from mstar_async.engines import Engine, Step
from mstar_async.transport import StepCall
from mstar_async.worker.scheduler import BatchStats, Job, Outcome, Scheduler

__all__ = ["BatchStats", "BatchingLoop"]


class _Waiter:
    """A submitter waiting for its step's outcome."""

    __slots__ = ("done", "outcome")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.outcome: Outcome | None = None


class BatchingLoop:
    """Runs the steps submitted to one worker's engines in batches.

    Start ``run()`` in a task group; ``submit`` from any task of the same event loop.
    ``max_batch_tokens`` caps the tokens one forward of an engine processes (decode steps cost
    one; a prefill gets what is left, so decodes are never starved by a long prompt);
    ``max_batch_size`` caps its steps; ``forward_time_bound_s`` caps the tokens further so one
    forward stays about that short. ``settle_rounds`` is how many scheduler passes the loop
    gives other tasks to submit before it runs a forward.

    Raises:
        ValueError: a limit is below 1, or the time bound is not positive.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        max_batch_tokens: int = 512,
        settle_rounds: int = 8,
        forward_time_bound_s: float = 0.1,
    ) -> None:
        self.scheduler = Scheduler(
            engines,
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            forward_time_bound_s=forward_time_bound_s,
        )
        self.engines = self.scheduler.engines  # the same dict: swapping an engine is seen
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.settle_rounds = settle_rounds
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    @property
    def stats(self) -> BatchStats:
        """What the loop ran: forwards, steps, batch sizes."""
        return self.scheduler.stats

    async def submit(self, call: StepCall) -> dict[str, Any]:
        """Queue one step and wait for its outputs.

        Cancel-safe: a step cancelled before the loop took it leaves the queue; one already in
        a forward finishes there and its outputs are dropped.

        Raises:
            EngineError: the engine is unknown here, or the forward failed (its cause attached).
        """
        waiter = _Waiter()
        job = Job(call.engine, Step(call.request_id, call.op, call.inputs), waiter)
        self.scheduler.submit(job)
        self._wake.set()
        try:
            await waiter.done.wait()
        except BaseException:
            self.scheduler.withdraw(job)
            raise
        if isinstance(waiter.outcome, BaseException):
            raise waiter.outcome
        assert waiter.outcome is not None
        return waiter.outcome

    async def release(self, request_id: str) -> None:
        """Tell every engine that ``request_id`` is over (finished, failed or cancelled).

        Runs on the forward thread, after any forward in flight, so engines see no races; then
        steps parked for memory run again. Shielded from cancellation: a release always
        completes.

        Raises:
            What an engine's ``release`` raised.
        """
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(
                    self.scheduler.release_engines, request_id, limiter=self._limiter
                )
            finally:
                self.scheduler.mark_released(request_id)
                if self.scheduler.has_work:
                    self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve submitted steps until cancelled.

        Cancel-safe: a round in flight finishes (its forward runs in a thread) and its outcomes
        are delivered, then the loop stops; steps still queued stay queued for their submitters
        to be cancelled.
        """
        task_status.started()
        while True:
            if not self.scheduler.has_work:
                self._wake = anyio.Event()
                await self._wake.wait()
            await self._settle()
            chosen = self.scheduler.take()
            if not chosen.batches:
                continue  # every submitter left while the loop settled
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    self.scheduler.forward, chosen, limiter=self._limiter
                )
                for job, outcome in self.scheduler.finish(chosen):
                    waiter: _Waiter = job.owner
                    waiter.outcome = outcome
                    waiter.done.set()

    async def _settle(self) -> None:
        quiet, size = 0, self.scheduler.queued
        for _ in range(self.settle_rounds):
            await anyio.lowlevel.checkpoint()
            quiet = quiet + 1 if self.scheduler.queued == size else 0
            size = self.scheduler.queued
            if quiet >= 2:
                return
