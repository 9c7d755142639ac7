"""Websocket ``/v1/audio/speech/stream``: text pushed in pieces, speech streamed back per segment.

Query: ``model`` (required), ``voice``, ``format`` (``pcm``: binary frames of little-endian
int16 samples, the default; ``json``: ``{"type": "audio", "segment", "data": base64}``), and
the extensions ``seed``, ``temperature``, ``top_p``, ``max_tokens``.

Client messages (JSON text frames): ``{"type": "text", "text"}`` (sentence ends flush),
``{"type": "flush"}``, ``{"type": "end"}``, ``{"type": "cancel"}``. Server messages:
``{"type": "ready", "sample_rate", "encoding": "pcm_s16le"}`` first, then audio, then
``{"type": "segment_done", "segment"}`` per segment, ``{"type": "cancelled"}`` after a cancel,
``{"type": "done"}`` after ``end`` once every segment is spoken (then the server closes), and
``{"type": "error", "error": {...}}`` for a bad message or a failed segment.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator
from contextlib import suppress
from typing import Any

import anyio
import msgspec
from anyio import ClosedResourceError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from mstar_async.outputs import AudioChunk
from mstar_async.server.encode import pcm_s16le
from mstar_async.server.errors import APIError, from_validation
from mstar_async.server.limits import check_limits, check_text_chars
from mstar_async.server.schemas import decode
from mstar_async.server.segments import SegmentAudio, SegmentDone, SegmentedSpeech, SentenceSplitter
from mstar_async.server.served import ServedModel
from mstar_async.server.speech_models import extension_inputs, sample_rate, speech_inputs
from mstar_async.server.state import ServerState, server_state
from mstar_async.server.tracked import TrackedRequest

STREAM_ROUTE = "/v1/audio/speech/stream"
#: Websocket close code for a policy violation (a bad query: unknown model, no speech).
POLICY_VIOLATION = 1008


class _Query(msgspec.Struct, kw_only=True):
    model: str
    voice: str | None = None
    format: str = "pcm"
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


class _Message(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class _Session:
    """One websocket's state: its model, its segments, and a lock so frames never interleave."""

    def __init__(self, ws: WebSocket, state: ServerState, served: ServedModel, query: _Query):
        self.ws = ws
        self.state = state
        self.served = served
        self.query = query
        self.inputs = extension_inputs(served, msgspec.structs.asdict(query))
        speech_inputs(served, "", query.voice)  # the voice is checked before any text comes
        self.splitter = SentenceSplitter()
        self.speech = SegmentedSpeech(self.speak)
        self.lock = anyio.Lock()
        self.ended = False

    async def send(self, message: dict[str, Any] | bytes) -> None:
        async with self.lock:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_json(message)

    async def speak(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        inputs = {**speech_inputs(self.served, text, self.query.voice), **self.inputs}
        tracked = await TrackedRequest.start(
            self.state, self.served, STREAM_ROUTE, inputs, prime=False
        )
        try:
            async for item in tracked.outputs():
                if isinstance(item, AudioChunk):
                    yield item
        finally:
            await tracked.close()

    async def emit(self, event: SegmentAudio | SegmentDone) -> None:
        if isinstance(event, SegmentDone):
            await self.send({"type": "segment_done", "segment": event.segment})
        elif self.query.format == "json":
            data = base64.b64encode(pcm_s16le(event.chunk.pcm)).decode("ascii")
            await self.send({"type": "audio", "segment": event.segment, "data": data})
        else:
            await self.send(pcm_s16le(event.chunk.pcm))

    async def synthesise(self, done: anyio.CancelScope) -> None:
        try:
            await self.speech.run(self.emit)
        except APIError as exc:
            await self.send({"type": "error", **exc.body()})
        else:
            await self.send({"type": "done"})
        done.cancel()

    async def push(self, text: str) -> None:
        """Buffer ``text``; queue the sentences it completes. A message that would make a
        segment, or the buffer, longer than the model's limits is refused whole (an error
        event; the buffer is as before it) and the session goes on."""
        before = self.splitter.pending
        sentences = self.splitter.push(text)
        try:
            # The buffer grows until a sentence ends: it may not outgrow a segment's limit.
            check_text_chars(self.served, self.splitter.pending, "text")
        except APIError as refused:
            self.splitter.restore(before)
            await self.send({"type": "error", **refused.body()})
            return
        if not await self.queue(sentences):
            self.splitter.restore(before)

    async def queue(self, segments: list[str]) -> bool:
        """Queue ``segments`` if each fits the model's limits (``check_limits``, before any of
        them is admitted); else send an error event naming the first that does not, queue
        none and return False."""
        try:
            for text in segments:
                inputs = {**speech_inputs(self.served, text, self.query.voice), **self.inputs}
                await check_limits(self.served, inputs)
        except APIError as refused:
            await self.send({"type": "error", **refused.body()})
            return False
        for text in segments:
            self.speech.queue(text)
        return True

    async def handle(self, raw: str) -> None:
        """Act on one client message."""
        try:
            message = decode(raw, _Message)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self.send({"type": "error", **from_validation(exc).body()})
            return
        except APIError as refused:
            await self.send({"type": "error", **refused.body()})
            return
        if self.ended and message.type in ("text", "flush", "end"):
            error = APIError(
                400, f"{message.type!r} after 'end': the input has ended", param="type"
            )
            await self.send({"type": "error", **error.body()})
        elif message.type == "text":
            await self.push(message.text)
        elif message.type in ("flush", "end"):
            if text := self.splitter.flush():
                await self.queue([text])
            if message.type == "end":
                self.speech.end_input()
                self.ended = True
        elif message.type == "cancel":
            self.splitter.clear()
            self.speech.cancel()
            await self.send({"type": "cancelled"})
        else:
            error = APIError(
                400,
                f"unknown message type {message.type!r}; send text, flush, end or cancel",
                param="type",
            )
            await self.send({"type": "error", **error.body()})


async def speech_stream(ws: WebSocket) -> None:
    """Serve one websocket speech session (see the module docstring for the protocol).

    A client that disconnects, or sends ``cancel``, stops the segment being spoken at once;
    its request is closed and its KV blocks are released.
    """
    await ws.accept()
    state = server_state(ws)
    try:
        query = msgspec.convert(dict(ws.query_params), _Query, strict=False)
        served = state.models.get_or_404(query.model)
        if query.format not in ("pcm", "json"):
            raise APIError(400, f"format {query.format!r}: use pcm or json", param="format")
        session = _Session(ws, state, served, query)
    except (APIError, msgspec.ValidationError) as exc:
        error = exc if isinstance(exc, APIError) else from_validation(exc)
        await ws.send_json({"type": "error", **error.body()})
        await ws.close(POLICY_VIOLATION)
        return
    await session.send(
        {"type": "ready", "sample_rate": sample_rate(served), "encoding": "pcm_s16le"}
    )
    left = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.synthesise, tg.cancel_scope)
            # After "end" this keeps listening, so a cancel or a disconnect still stops speech.
            while True:
                await session.handle(await _receive_text(ws))
    except* (WebSocketDisconnect, ClosedResourceError):
        left = True  # the task group has cancelled (and closed) the request being spoken
    if not left:
        with suppress(RuntimeError):  # the client closed first
            await ws.close()


async def _receive_text(ws: WebSocket) -> str:
    """The next text frame; a binary frame reads as invalid JSON (answered with an error)."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    return text if isinstance(text, str) else "<a binary frame: send JSON text frames>"


def routes() -> list[BaseRoute]:
    """The websocket speech route."""
    return [WebSocketRoute(STREAM_ROUTE, speech_stream)]
