"""The conductor: runs many request programs at once and streams their outputs."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import TracebackType
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from mstar_async.conductor.executor import StepExecutor
from mstar_async.conductor.metrics import RequestMetrics
from mstar_async.conductor.outbox import Outbox
from mstar_async.conductor.request import RequestContext
from mstar_async.conductor.task_owner import TaskGroupOwner
from mstar_async.conductor.walk_stream import WalkHost
from mstar_async.errors import MstarError, RequestCancelled, RequestError
from mstar_async.graph import Model
from mstar_async.logs import get_logger

log = get_logger("mstar_async.conductor")

#: How many program outputs may wait for the client before the program is held back.
OUTPUT_BUFFER = 16


def unwrap(exc: BaseException) -> BaseException:
    """The single leaf of nested exception groups, or ``exc`` itself when there are several."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class RequestStream:
    """A request's outputs, in order, as they are made: an async iterator you must close.

    Use ``async with conductor.generate(...) as outputs: async for item in outputs: ...`` or
    call ``aclose()``; closing early cancels the request, and ``aclose()`` returns only once
    its walks have stopped, its channels are closed and its engines have released it.
    ``metrics`` fills in as the request runs (first-output times, audio, tokens, outcome).
    """

    def __init__(self, request_id: str, outbox: Outbox) -> None:
        self.request_id = request_id
        self.metrics = RequestMetrics(request_id)
        self.context: RequestContext | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._outbox = outbox
        self._scope = anyio.CancelScope()
        self._finished = anyio.Event()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        """The next output.

        Raises:
            RequestError: the request failed (the cause attached); ``RequestCancelled`` if it
                was cancelled from elsewhere (a timeout, ``conductor.cancel``).
        """
        try:
            return await self._outbox.get()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._outbox.close_reader()
        await self._finished.wait()
        if self.error is not None:
            raise RequestError(f"request {self.request_id} failed: {self.error}") from self.error
        if self.cancelled:
            raise RequestCancelled(f"request {self.request_id} was cancelled")
        raise StopAsyncIteration

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def cancel(self) -> None:
        """Ask the request to stop; it ends (and releases everything) on its next checkpoint."""
        self._scope.cancel()

    async def aclose(self) -> None:
        """Cancel the request if it still runs and wait until it has released everything.

        Safe from a cancelled task: the wait is shielded and lasts until the step in flight ends.
        """
        if not self._finished.is_set():
            self._scope.cancel()
        self._outbox.close_reader()
        with anyio.CancelScope(shield=True):
            await self._finished.wait()


class Conductor(TaskGroupOwner):
    """Runs request programs of one model: their walks run on ``walks`` (where their nodes
    are), and ``executor`` releases a request's state when it ends.

    Use as ``async with Conductor(model, executor) as conductor:``; leaving the block cancels
    requests still running. Runs on the host's event loop (asyncio or uvloop), owning no loop.
    """

    def __init__(
        self,
        model: Model,
        executor: StepExecutor,
        *,
        walks: WalkHost,
        output_buffer: int = OUTPUT_BUFFER,
    ) -> None:
        self.model = model
        self.executor = executor
        self.walks = walks
        self.output_buffer = output_buffer
        self.active: dict[str, RequestStream] = {}
        self._task_group: TaskGroup | None = None
        self._signature = inspect.signature(model.program)

    def generate(self, *, request_id: str | None = None, **inputs: Any) -> RequestStream:
        """Start a request of the model's program with ``inputs`` and return its output stream.

        Raises:
            RuntimeError: the conductor is not open (use ``async with``).
            RequestError: ``inputs`` do not fit the program's signature (names the problem).
        """
        if self._task_group is None:
            raise RuntimeError("the conductor is not running; use 'async with Conductor(...)'")
        try:
            self._signature.bind(None, **inputs)
        except TypeError as exc:
            raise RequestError(f"model {self.model.name!r}: bad request inputs: {exc}") from None
        request_id = request_id or uuid.uuid4().hex[:16]
        outbox = Outbox(self.output_buffer)
        stream = RequestStream(request_id, outbox)
        self.active[request_id] = stream
        self._task_group.start_soon(self._serve, stream, inputs, name=f"request {request_id}")
        return stream

    async def _serve(self, stream: RequestStream, inputs: dict[str, Any]) -> None:
        with structlog.contextvars.bound_contextvars(request_id=stream.request_id):
            log.debug("request.start", model=self.model.name)
            completed = False
            try:
                with stream._scope:
                    await self._run_program(stream, inputs)
                    completed = True
            except Exception as exc:  # a failure of this request only; never a cancellation
                stream.error = _as_request_failure(unwrap(exc), stream)
            finally:
                stream.cancelled = stream.cancelled or (not completed and stream.error is None)
                stream._outbox.close_producer()
                if not (completed and stream._outbox.buffered):
                    # What a finished request left in the buffer stays for a client that reads
                    # it later (its ``__anext__`` closes this end at the end of the stream).
                    stream._outbox.close_reader()
                if stream.context is not None:
                    stream.context.cancel_walks()
                    stream.context.close_channels(keep=stream._outbox)
                with anyio.CancelScope(shield=True):
                    await self.executor.release(stream.request_id)
                self.active.pop(stream.request_id, None)
                stream.metrics.close(cancelled=stream.cancelled, failed=stream.error is not None)
                stream._finished.set()
                log.info(
                    "request.end",
                    model=self.model.name,
                    error=repr(stream.error) if stream.error else None,
                    **stream.metrics.as_log(),
                )

    async def _run_program(self, stream: RequestStream, inputs: dict[str, Any]) -> None:
        async with anyio.create_task_group() as walks:
            context = RequestContext(
                stream.request_id,
                self.model,
                self.executor,
                walks,
                metrics=stream.metrics,
                walks=self.walks,
            )
            stream.context = context
            context.track(stream._outbox)
            async with aclosing(self.model.program(context, **inputs)) as program:
                outbox = stream._outbox
                async for item in program:
                    stream.metrics.observe(item)
                    if not outbox.try_put(item):
                        await outbox.put(item)
            if context.spawned:  # (a cancel formats its task's repr: not free)
                walks.cancel_scope.cancel()  # walks the program left open have nobody to read them


def _as_request_failure(exc: BaseException, stream: RequestStream) -> BaseException | None:
    if isinstance(exc, anyio.BrokenResourceError | anyio.ClosedResourceError):
        stream.cancelled = True  # the client stopped reading: that is a cancellation
        return None
    if not isinstance(exc, MstarError):
        log.error("request.failed", error=repr(exc))
    return exc
