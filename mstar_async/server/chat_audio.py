"""Spoken chat replies: ``modalities: ["text", "audio"]`` on ``/v1/chat/completions``.

For a model that speaks (qwen3-omni), as OpenAI's audio chat does: a whole reply's message has
``content: null`` and ``audio: {id, data, transcript, expires_at}`` with ``data`` the base64
of the whole audio in ``audio.format``; a stream's deltas carry ``audio.transcript`` pieces as
the text is made and ``audio.data`` pieces (base64 little-endian int16 PCM) as the speech is,
interleaved in the order the model makes them, and a last audio delta carries ``expires_at``.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mstar_async.audio import AudioEncoder
from mstar_async.outputs import AudioChunk, TextDelta
from mstar_async.server.errors import APIError
from mstar_async.server.schemas import ChatCompletionRequest
from mstar_async.server.served import ServedModel
from mstar_async.server.speech_models import (
    audio_format,
    sample_rate,
    voice_inputs,
    voice_name,
)
from mstar_async.server.sse import DONE, sse_event
from mstar_async.server.tracked import TrackedRequest

if TYPE_CHECKING:
    from mstar_async.server.openai_text import ResponseShape

#: ``audio.format`` values served; a stream sends pcm16 only, as OpenAI's does.
CHAT_AUDIO_FORMATS = ("wav", "flac", "mp3", "opus", "pcm16")
#: How long a reply's audio id is said to stay valid (nothing is stored: it is informational).
EXPIRES_IN_SECONDS = 3600


@dataclass(frozen=True)
class SpokenReply:
    """How the reply's audio is encoded, and its id."""

    format: str
    id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")

    @property
    def expires_at(self) -> int:
        """OpenAI's ``expires_at``: now plus ``EXPIRES_IN_SECONDS``."""
        return int(time.time()) + EXPIRES_IN_SECONDS


def spoken_reply(
    body: ChatCompletionRequest, served: ServedModel
) -> tuple[SpokenReply | None, dict[str, Any]]:
    """Whether the request asks for audio, and the program inputs that give (or skip) it.

    A text-only request to a model that speaks gets ``speak=False`` (no speech computed).

    Raises:
        APIError: 400 naming the field: ``audio`` missing, a format not served (or not pcm16
            in a stream), a voice the model lacks, or a model that does not speak.
    """
    if "audio" not in (body.modalities or ["text"]):
        return None, ({"speak": False} if "speak" in served.inputs else {})
    if body.audio is None:
        raise APIError(
            400,
            'modalities include "audio": give audio: {"voice": ..., "format": ...}',
            param="audio",
        )
    if served.runtime.model.info.get("sample_rate") is None or "speak" not in served.inputs:
        raise APIError(
            400,
            f"model {served.name!r} does not speak; serve a model that does (qwen3-omni) "
            'or drop "audio" from modalities',
            param="modalities",
        )
    allowed = ("pcm16",) if body.stream else CHAT_AUDIO_FORMATS
    fmt = audio_format(body.audio.format, allowed=allowed, param="audio.format")
    inputs = voice_inputs(served, voice_name(body.audio.voice), voice_param="audio.voice")
    return SpokenReply(fmt), inputs


async def whole_message(tracked: TrackedRequest, reply: SpokenReply) -> dict[str, Any]:
    """The reply's message: ``content`` null, ``audio`` the whole speech and its transcript.

    Raises:
        APIError: the request failed midway.
    """
    encoder = AudioEncoder(reply.format)
    text, audio = [], []
    async for item in tracked.outputs():
        if isinstance(item, TextDelta):
            text.append(item.text)
        elif isinstance(item, AudioChunk):
            audio.append(encoder.encode(item))
    audio.append(encoder.finish(sample_rate(tracked.served)))
    return {
        "role": "assistant",
        "content": None,
        "audio": {
            "id": reply.id,
            "data": _b64(b"".join(audio)),
            "transcript": "".join(text),
            "expires_at": reply.expires_at,
        },
    }


async def stream_chunks(
    tracked: TrackedRequest, shape: ResponseShape, reply: SpokenReply, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    """The streamed reply: role, then transcript and audio deltas as they come, then the
    ``expires_at`` delta, the finish chunk, the usage chunk (``include_usage``) and ``[DONE]``.
    Closes the request however it ends."""
    encoder = AudioEncoder(reply.format)
    try:
        opening = {"role": "assistant", "content": None, "audio": {"id": reply.id}}
        yield sse_event(shape.delta_chunk(opening))
        async for item in tracked.outputs():
            if isinstance(item, TextDelta):
                delta = {"audio": {"id": reply.id, "transcript": item.text}}
                yield sse_event(shape.delta_chunk(delta))
            elif isinstance(item, AudioChunk) and (data := encoder.encode(item)):
                delta = {"audio": {"id": reply.id, "data": _b64(data)}}
                yield sse_event(shape.delta_chunk(delta))
        ending = {"audio": {"id": reply.id, "expires_at": reply.expires_at}}
        yield sse_event(shape.delta_chunk(ending))
        yield sse_event(shape.delta_chunk({}, tracked.finish_reason()))
        if include_usage:
            yield sse_event(shape.usage_chunk(tracked.usage()))
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await tracked.close()
    yield DONE


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
