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
    FeedWalk,
    Link,
    StartWalk,
    TensorRef,
    WalkCredit,
    WalkUpdates,
)
from mstar_async.walks.run import WalkRun
from mstar_async.worker.tensor_links import WorkerTensors
from mstar_async.worker.walk_loop import WalkLoop

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
        self._fed: list[tuple[int, str]] = []
        # Walks whose inputs are still being fetched: what arrived for them meanwhile (feeds,
        # or None for a cancel), applied in order once they start.
        self._starting: dict[int, list[FeedWalk | None]] = {}
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Something is waiting in the outbox."""
        self._wake.set()

    def begin(self, message: StartWalk) -> None:
        """Note that walk ``message.id`` is starting (call in message order, before
        ``start``), so feeds and cancels that arrive while its inputs are fetched wait."""
        self._starting[message.id] = []

    async def start(self, message: StartWalk) -> None:
        """Start the walk ``message`` names (after ``begin``); a bad walk ends at once with its
        error. Cancel-safe (nothing is started when cancelled while fetching inputs)."""
        sink = _Sink(self, message.id)
        try:
            plan = self.model.plan(message.walk)
            inputs = {
                PortRef.parse(k, role="walk input"): await self._local(v)
                for k, v in message.inputs.items()
            }
            persisted = {
                PortRef.parse(k, role="walk input"): await self._local(v)
                for k, v in message.persisted.items()
            }
        except Exception as exc:
            self._starting.pop(message.id, None)
            sink.end({}, exc)
            return
        except BaseException:
            self._starting.pop(message.id, None)
            raise
        run = self.loop.start_walk(
            plan,
            message.request_id,
            inputs,
            message.params,
            persisted,
            sink,
            window=message.window,
        )
        self.runs[message.id] = run
        for early in self._starting.pop(message.id):
            if early is None:
                run.cancel()
            else:
                self.feed(early)

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
            if walk_id in self._starting:
                self._starting[walk_id].append(None)
            run = self.runs.get(walk_id)
            if run is not None:
                run.cancel()
        self.loop.kick()

    def feed(self, message: FeedWalk) -> None:
        """Items (or the end) of a walk's streamed input; acknowledged once it has room."""
        if message.id in self._starting:
            self._starting[message.id].append(message)
            return
        run = self.runs.get(message.id)
        if run is None:
            self._acknowledge(message.id, message.port)  # the walk has ended: nothing waits
            return
        port = PortRef.parse(message.port, role="walk stream")
        try:
            if message.end:
                run.end_input(port)
                return
            run.feed(port, message.items, lambda: self._acknowledge(message.id, message.port))
        except Exception as exc:  # a bad feed fails its walk, not the worker
            run.group.cancel(exc)
        finally:
            self.loop.kick()

    def _acknowledge(self, walk_id: int, port: str) -> None:
        self._fed.append((walk_id, port))
        self.wake()

    def cancel_request(self, request_id: str) -> None:
        """Stop every walk of ``request_id`` still running here (its release has come)."""
        for run in [r for r in self.runs.values() if r.request_id == request_id]:
            run.cancel()

    def ended(
        self, walk_id: int, persisted: dict[PortRef, Any], error: BaseException | None
    ) -> None:
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
            if not (self.events or self._ended or self._errors or self._fed):
                continue
            message = WalkUpdates(self.events, self._ended, self._errors, self._fed)
            self.events, self._ended, self._errors, self._fed = [], [], {}, []
            await self.link.send(message)
