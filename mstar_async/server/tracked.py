"""One admitted request as the HTTP layer sees it: admission, timing, metrics, cancellation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from mstar_async.errors import RequestCancelled, RequestError
from mstar_async.outputs import TextEnd
from mstar_async.server.admission import Ticket
from mstar_async.server.errors import APIError
from mstar_async.server.limits import SAME_NAMES, FieldNames, check_limits
from mstar_async.server.served import ServedModel

if TYPE_CHECKING:
    from mstar_async.conductor import RequestStream
    from mstar_async.server.metrics import ServerMetrics
    from mstar_async.server.state import ServerState

#: The status counted for a request whose client went away before it finished (nginx's).
CLIENT_CLOSED = 499
RETRY_AFTER_SECONDS = 1
#: A request that failed before its response began: the error handler counts that response.
ANSWERED_AS_ERROR = 0
_UNPRIMED = object()


class TrackedRequest:
    """A request admitted to a served model: iterate ``outputs()``, then always ``close()``.

    ``start(..., prime=True)`` runs the request up to its first output, so inputs the program
    rejects become a 400 before a response has begun. ``close()`` cancels the request if it
    still runs, waits until it has released its engines' memory, gives its admission ticket
    back and records its metrics.
    """

    def __init__(
        self,
        state: ServerState,
        served: ServedModel,
        route: str,
        stream: RequestStream,
        ticket: Ticket,
        arrived: float,
    ) -> None:
        self.state = state
        self.served = served
        self.route = route
        self.stream = stream
        self.end: TextEnd | None = None
        self.status = CLIENT_CLOSED
        self._ticket: Ticket | None = ticket
        self._arrived = arrived
        self._first: Any = _UNPRIMED
        self._started = False
        state.metrics.in_flight.labels(model=served.name).inc()

    @classmethod
    async def start(
        cls,
        state: ServerState,
        served: ServedModel,
        route: str,
        inputs: dict[str, Any],
        *,
        prime: bool = True,
        fields: FieldNames = SAME_NAMES,
    ) -> TrackedRequest:
        """Check the request against the model's limits (``check_limits``; ``fields`` names
        the request fields that carry the inputs), then admit and start it with program
        ``inputs``; with ``prime``, wait for its first output (a route that answers at once,
        like a chat stream's role chunk, does not).

        Cancel-safe: a cancelled start closes the request and frees its place.

        Raises:
            APIError: 400 when the request is past a limit (before admission), the inputs do
                not fit the program or the program rejects them; 429 (with Retry-After) when
                the model is at its in-flight bound; 500 when it fails.
        """
        arrived = time.perf_counter()
        await check_limits(served, inputs, fields)
        ticket = served.admission.try_enter()
        if ticket is None:
            raise APIError(
                429,
                f"model {served.name!r} is serving its limit of {served.admission.limit} "
                "requests; retry later",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        try:
            stream = served.runtime.generate(**inputs)
        except RequestError as exc:
            ticket.release()
            raise APIError(400, str(exc), param="inputs") from None
        tracked = cls(state, served, route, stream, ticket, arrived)
        if not prime:
            return tracked
        try:
            tracked._first = await tracked._next()
        except BaseException:
            tracked.status = ANSWERED_AS_ERROR
            await tracked.close()
            raise
        return tracked

    async def outputs(self) -> AsyncIterator[Any]:
        """The request's outputs, the first one included; ``TextEnd`` is kept in ``end``.

        Raises:
            APIError: 500 when the request fails midway.
        """
        item, self._first = self._first, None
        if item is _UNPRIMED:
            item = await self._next()
        while item is not None:
            if isinstance(item, TextEnd):
                self.end = item
            else:
                yield item
            item = await self._next()
        self.status = 200

    async def close(self) -> None:
        """End the request (cancelling it if it runs), free its place, record its metrics.

        Safe to call twice and from a cancelled task (the wait for release is shielded).
        """
        if self._ticket is None:
            return
        ticket, self._ticket = self._ticket, None
        await self.stream.aclose()
        ticket.release()
        metrics, model = self.state.metrics, self.served.name
        metrics.in_flight.labels(model=model).dec()
        if self.status != ANSWERED_AS_ERROR:
            metrics.count(model, self.route, self.status)
        if self.status == 200:
            metrics.latency.labels(model=model, route=self.route).observe(self._elapsed())
        self._record_audio(metrics, model)
        if self.end is not None:
            metrics.prompt_tokens.labels(model=model).inc(self.end.prompt_tokens)
            metrics.output_tokens.labels(model=model).inc(self.end.completion_tokens)

    def _record_audio(self, metrics: ServerMetrics, model: str) -> None:
        figures = self.stream.metrics
        if self.status != 200 or figures.ttfa is None:
            return
        metrics.ttfa.labels(model=model, route=self.route).observe(figures.ttfa)
        if figures.rtf is not None:
            metrics.rtf.labels(model=model, route=self.route).observe(figures.rtf)

    def finish_reason(self) -> str:
        """Why the text ended (``"stop"`` when the model reported nothing)."""
        return self.end.finish_reason if self.end is not None else "stop"

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` from the closing ``TextEnd`` (zeros without one)."""
        prompt = self.end.prompt_tokens if self.end is not None else 0
        completion = self.end.completion_tokens if self.end is not None else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def _next(self) -> Any:
        """The next output, or None at the end; the first one records the TTFB."""
        try:
            item = await self.stream.__anext__()
        except StopAsyncIteration:
            return None
        except RequestCancelled:
            raise
        except RequestError as exc:
            self.status = _status_of(exc)
            raise APIError(self.status, str(exc.__cause__ or exc), param=None) from None
        if not self._started:
            self._started = True
            self.state.metrics.ttfb.labels(model=self.served.name, route=self.route).observe(
                self._elapsed()
            )
        return item

    def _elapsed(self) -> float:
        return time.perf_counter() - self._arrived


def _status_of(exc: RequestError) -> int:
    """400 when the program rejected its inputs (a ValueError or TypeError: no runtime error
    is one, so only input checks raise them), else 500."""
    return 400 if isinstance(exc.__cause__, ValueError | TypeError) else 500
