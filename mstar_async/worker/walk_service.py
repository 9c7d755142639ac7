"""A worker process's side of hosted walks: start what the conductor asks, send back what they
make, one ``WalkUpdates`` message per round.

Walk outputs collect in an outbox while the batching loop runs; a sender task wakes when the
loop lets other tasks run (after a round's forward) and sends everything collected as one
message. Credit and cancels arrive as ``WalkCredit``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mstar_async.graph import Model, PortRef
from mstar_async.logs import get_logger
from mstar_async.transport import (
    ErrorInfo,
    Link,
    StartWalk,
    TensorRef,
    WalkCredit,
    WalkUpdates,
)
from mstar_async.worker.tensor_links import WorkerTensors
from mstar_async.worker.walk_loop import WalkLoop
from mstar_async.worker.walk_run import WalkRun

log = get_logger("mstar_async.worker.walks")


class _Sink:
    """One hosted walk's ``WalkSink``: its outputs go to the service's outbox."""

    __slots__ = ("service", "walk_id")

    def __init__(self, service: WalkService, walk_id: int) -> None:
        self.service = service
        self.walk_id = walk_id

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.service.events.append([self.walk_id, port, value, iteration])
        self.service.wake()

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.service.ended(self.walk_id, persisted, error)


class WalkService:
    """Runs the walks the conductor starts on this worker's ``WalkLoop``."""

    def __init__(self, model: Model, loop: WalkLoop, link: Link, tensors: WorkerTensors) -> None:
        self.model = model
        self.loop = loop
        self.link = link
        self.tensors = tensors
        self.runs: dict[int, WalkRun] = {}
        self.events: list[Any] = []
        self._ended: list[Any] = []
        self._errors: dict[int, ErrorInfo] = {}
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Something is waiting in the outbox."""
        self._wake.set()

    async def start(self, message: StartWalk) -> None:
        """Start the walk ``message`` names; a bad walk ends at once with its error.
        Cancel-safe (nothing is started when cancelled while fetching inputs)."""
        sink = _Sink(self, message.id)
        try:
            plan = self.model.plan(message.walk)
            inputs = {PortRef.parse(k, role="walk input"): await self._local(v) for k, v in message.inputs.items()}
            persisted = {
                PortRef.parse(k, role="walk input"): await self._local(v) for k, v in message.persisted.items()
            }
        except Exception as exc:
            sink.end({}, exc)
            return
        self.runs[message.id] = self.loop.start_walk(
            plan, message.request_id, inputs, message.params, persisted, sink,
            window=message.window,
        )

    async def _local(self, value: Any) -> Any:
        # A handle to a tensor another worker (or this one) holds: the walk needs the tensor.
        if isinstance(value, TensorRef):
            return await self.tensors.fetch(value)
        return value

    def credit(self, message: WalkCredit) -> None:
        """Return credit to walks and stop those the conductor cancelled."""
        for walk_id, count in message.credits.items():
            run = self.runs.get(walk_id)
            if run is not None:
                run.ack(count)
        for walk_id in message.cancel:
            run = self.runs.get(walk_id)
            if run is not None:
                run.cancel()
        self.loop.kick()

    def cancel_request(self, request_id: str) -> None:
        """Stop every walk of ``request_id`` still running here (its release has come)."""
        for run in [r for r in self.runs.values() if r.request_id == request_id]:
            run.cancel()

    def ended(self, walk_id: int, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        """A walk is over: its end goes out with the next message."""
        self.runs.pop(walk_id, None)
        if error is None:
            self._ended.append([walk_id, {str(ref): value for ref, value in persisted.items()}])
        else:
            self._errors[walk_id] = ErrorInfo.from_exception(error)
        self.wake()

    async def send_updates(self) -> None:
        """Send what the walks made, one message per wake-up, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not (self.events or self._ended or self._errors):
                continue
            message = WalkUpdates(self.events, self._ended, self._errors)
            self.events, self._ended, self._errors = [], [], {}
            await self.link.send(message)
