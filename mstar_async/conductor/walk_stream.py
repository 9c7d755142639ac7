"""A running walk as its request program sees it: an async iterator of ``WalkEvent``s.

A ``WalkHost`` runs the whole walk, loops included, where its nodes are (a worker's batching
loop in this process or in a worker process; for a walk whose nodes span ranks, each rank's
worker its own part, its segment) and sends its outputs back. The conductor only
starts the walk, hands the outputs to the program, and returns credit as the program reads
them, so a program that stops reading holds the walk back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from mstar_async.conductor.checkpoints import CancelPoints
from mstar_async.graph import PortRef, WalkPlan

if TYPE_CHECKING:
    from mstar_async.conductor.request import RequestContext


@dataclass(frozen=True, slots=True)
class WalkEvent:
    """One output of a walk as it is made: which port, its value, and the loop iteration."""

    port: str
    value: Any
    iteration: int


class WalkControl(Protocol):
    """The conductor's handle on a walk running elsewhere."""

    def ack(self, count: int) -> None:
        """The program has read ``count`` more outputs (credit back to the walk)."""
        ...

    def cancel(self) -> None:
        """Stop the walk; its sink hears ``end`` (at once in process, soon across processes)."""
        ...

    async def feed(self, port: PortRef, items: Any) -> None:
        """Items of the walk's streamed input ``port``; returns once it has room for more (or
        the walk has ended). Cancel-safe."""
        ...

    def end_input(self, port: PortRef) -> None:
        """The walk's streamed input ``port`` has ended."""
        ...


class WalkHost(Protocol):
    """Runs whole walks where their nodes live."""

    def open_walk(
        self,
        request_id: str,
        plan: WalkPlan,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
    ) -> WalkControl:
        """Start the walk; its outputs and end go to ``sink``. Never raises: errors reach
        the sink."""
        ...


class WalkInbox:
    """The outputs of one hosted walk, waiting for the program (a ``WalkSink``)."""

    __slots__ = ("_waiter", "ended", "error", "events", "persisted")

    def __init__(self) -> None:
        self.events: deque[WalkEvent] = deque()
        self.ended = False
        self.error: BaseException | None = None
        self.persisted: dict[PortRef, Any] = {}
        self._waiter: asyncio.Future[None] | None = None

    def emit(self, port: str, value: Any, iteration: int) -> None:
        """One output of the walk, in order."""
        self.events.append(WalkEvent(port, value, iteration))
        self._wake()

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        """The walk is over (idempotent: the first end counts)."""
        if self.ended:
            return
        self.ended = True
        self.persisted = persisted
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Wait until something arrives (an output or the end)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None


class WalkStream:
    """The outputs of one walk running on a ``WalkHost``, as an async iterator of
    ``WalkEvent``s.

    The walk starts on ``async with`` (or the first ``__anext__``); ``aclose()`` stops it and
    waits until it has ended. An error inside the walk is raised to the reader.
    """

    def __init__(
        self,
        request: RequestContext,
        host: WalkHost,
        plan: WalkPlan,
        inputs: dict[PortRef, Any],
        params: dict[str, Any],
    ) -> None:
        self._request = request
        self._host = host
        self._plan = plan
        self._inputs = inputs
        self._params = params
        self._inbox = WalkInbox()
        self._control: WalkControl | None = None
        self._error_seen = False
        self._cancel_points = CancelPoints()
        self._feeders: list[anyio.CancelScope] = []

    @property
    def ended(self) -> bool:
        """Whether the walk has ended (or never started)."""
        return self._control is None or self._inbox.ended

    def _start(self) -> None:
        if self._control is None:
            persisted = self._request.persisted
            needed = {
                src: persisted[src] for src in self._plan.persisted_in.values() if src in persisted
            }
            streamed = self._plan.input_streams
            inputs = {ref: v for ref, v in self._inputs.items() if ref not in streamed}
            self._request.walk_streams.append(self)
            control = self._host.open_walk(
                self._request.request_id, self._plan, inputs, self._params, needed, self._inbox
            )
            self._control = control
            for ref in streamed:
                scope = anyio.CancelScope()
                self._feeders.append(scope)
                self._request.start_soon(self._feed, control, ref, self._inputs[ref], scope)

    async def _feed(
        self, control: WalkControl, port: PortRef, source: AsyncIterable[Any], scope: Any
    ) -> None:
        # Items reach the walk as they arrive; ``feed`` returns when the input has room, so a
        # source faster than the walk is held back (it is never read ahead unboundedly).
        with scope:
            try:
                async with aclosing(aiter(source)) as items:  # type: ignore[type-var]
                    async for item in items:
                        if self._inbox.ended:
                            break
                        await control.feed(port, item)
            finally:
                if not self._inbox.ended:
                    control.end_input(port)

    def cancel(self) -> None:
        """Ask the walk to stop (no wait); idempotent."""
        for scope in self._feeders:
            scope.cancel()
        if self._control is not None and not self._inbox.ended:
            self._control.cancel()

    async def __aenter__(self) -> WalkStream:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose(raise_error=exc is None)

    def __aiter__(self) -> AsyncIterator[WalkEvent]:
        return self

    async def __anext__(self) -> WalkEvent:
        """The next output of the walk.

        Raises:
            MstarError: the walk failed (a step's error, a missing input).
        """
        if self._control is None:
            self._start()
        inbox = self._inbox
        # Cancel-safe: an output is taken only when this returns it.
        if self._cancel_points.due():
            await checkpoint_if_cancelled()
        while not inbox.events:
            if inbox.ended:
                self._finish()
                raise StopAsyncIteration
            await inbox.wait()
        event = inbox.events.popleft()
        assert self._control is not None
        self._control.ack(1)
        return event

    def _finish(self) -> None:
        inbox = self._inbox
        if inbox.error is None:
            self._request.persisted.update(inbox.persisted)
        elif not self._error_seen:
            self._error_seen = True
            raise inbox.error

    async def aclose(self, *, raise_error: bool = True) -> None:
        """Stop the walk if it still runs and wait until it has ended.

        Safe to call more than once and from a cancelled task (the wait is shielded; it lasts
        at most until the step in flight returns).

        Raises:
            MstarError: the walk had failed and nobody has seen its error yet.
        """
        if self._control is None:
            return
        self.cancel()
        with anyio.CancelScope(shield=True):
            while not self._inbox.ended:
                await self._inbox.wait()
        if raise_error:
            self._finish()
        else:
            self._error_seen = True
