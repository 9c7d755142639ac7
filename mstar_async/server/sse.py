"""Streaming responses that notice a client leaving: server-sent events and NDJSON.

uvicorn drops writes to a closed connection silently, so a response that only writes would
learn of a departed client at best on its next write. These responses also listen for the
ASGI ``http.disconnect`` message and cancel the stream at once, so the request behind it is
cancelled and releases its memory while its model is still computing the next output.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mstar_async.conductor.conductor import unwrap

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse_event(data: Any) -> bytes:
    """One server-sent event whose ``data`` is ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def ndjson_line(data: Any) -> bytes:
    """One NDJSON line."""
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


class EventStreamResponse(Response):
    """An ASGI response streaming the byte chunks of ``body``, closed when the client leaves.

    ``body`` is closed (``aclose``) however the response ends, so ``finally`` blocks in it run:
    that is where a route closes its request. ``media_type`` is ``text/event-stream`` for SSE
    or ``application/x-ndjson``.
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        *,
        media_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        # Response's own __init__ would render a fixed body with a content-length.
        self.chunks = body
        self.status_code = 200
        self.background = None
        self.media_type = media_type
        self.extra_headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        self.extra_headers.update(headers or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream; cancel it when the client disconnects.

        Cancel-safe: a cancelled response closes its body (and so its request) before it ends.
        """
        try:
            async with aclosing(self.chunks), anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                await send({"type": "http.response.start", "status": 200, "headers": self._raw()})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise unwrap(group) from None

    def _raw(self) -> list[tuple[bytes, bytes]]:
        headers = {"content-type": self.media_type or "text/event-stream", **self.extra_headers}
        return [(k.lower().encode(), v.encode()) for k, v in headers.items()]


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def unless_disconnected(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T | None:
    """``await fn()``, cancelled when the client disconnects first (then None).

    Use after the request body has been read: the next ASGI message is then the disconnect.
    Raises what ``fn`` raises.
    """
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            result.append(await fn())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise unwrap(group) from None
    return result[0] if result else None
