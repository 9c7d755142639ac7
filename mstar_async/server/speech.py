"""``POST /v1/audio/speech``: OpenAI's text-to-speech route, streamed as it is synthesised.

``stream_format: "audio"`` answers a chunked body of the encoded audio (``response_format``
wav, flac, mp3, opus or pcm) written chunk by chunk as the model makes it; ``"sse"`` answers
``speech.audio.delta`` events carrying base64 pieces of the same bytes, then one
``speech.audio.done``. The sample rate goes in the ``x-sample-rate`` header (and in the WAV
header) before the first sample.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mstar_async.audio import AudioEncoder
from mstar_async.outputs import AudioChunk
from mstar_async.server.errors import APIError
from mstar_async.server.limits import FieldNames
from mstar_async.server.schemas import SpeechRequest, decode
from mstar_async.server.speech_models import (
    MEDIA_TYPES,
    audio_format,
    extension_inputs,
    sample_rate,
    speech_inputs,
    voice_name,
)
from mstar_async.server.sse import EventStreamResponse, sse_event
from mstar_async.server.state import server_state
from mstar_async.server.tracked import TrackedRequest
from mstar_async.server.voices import decode_base64, ref_audio_inputs, registered_voice
from mstar_async.voices.store import valid_id

SPEECH_ROUTE = "/v1/audio/speech"
#: The text to speak is ``input`` in the body.
FIELDS = FieldNames({"text": "input"})
#: ``response_format`` values served, in the order errors list them.
SPEECH_FORMATS = ("wav", "flac", "mp3", "opus", "pcm")


async def speech(request: Request) -> Response:
    """Speak ``input`` with a speech model and stream the encoded audio.

    Raises:
        APIError, msgspec.ValidationError: a bad body (400 naming the field: an unsupported
            ``response_format`` lists the supported ones), an unknown model (404), a model
            that does not speak (400, ``param: "model"``), overload (429).
    """
    body = decode(await request.body(), SpeechRequest)
    state = server_state(request)
    served = state.models.get_or_404(body.model)
    request.state.model = served.name
    fmt = audio_format(body.response_format, allowed=SPEECH_FORMATS, param="response_format")
    _check_unsupported(body, served.inputs)
    rate = sample_rate(served)
    inputs = await _voice_inputs(state, served, body)
    inputs.update(extension_inputs(served, _extensions(body)))
    tracked = await TrackedRequest.start(state, served, SPEECH_ROUTE, inputs, fields=FIELDS)
    headers = {"x-sample-rate": str(rate)}
    if body.stream_format == "sse":
        return EventStreamResponse(_events(tracked, fmt, rate), headers=headers)
    media = MEDIA_TYPES[body.response_format]
    return EventStreamResponse(_audio(tracked, fmt, rate), media_type=media, headers=headers)


def routes() -> list[Route]:
    """The speech route."""
    return [Route(SPEECH_ROUTE, speech, methods=["POST"])]


async def _voice_inputs(state: Any, served: Any, body: SpeechRequest) -> dict[str, Any]:
    """The text and voice inputs: a registered voice id, a one-off ``ref_audio`` (cloned for
    this request), or a named voice; ``instructions`` where the model takes ``instruct``."""
    voice = voice_name(body.voice)
    if body.ref_audio is not None:
        if voice:
            raise APIError(400, "give either voice or ref_audio, not both", param="ref_audio")
        limits = next(iter(state.voices.values())).store.limits if state.voices else None
        inputs = {
            "text": body.input,
            **ref_audio_inputs(
                served,
                decode_base64(body.ref_audio, param="ref_audio"),
                body.ref_text,
                max_seconds=limits.max_audio_seconds if limits else 30.0,
            ),
        }
    elif voice is not None and valid_id(voice):
        sample_rate(served)
        inputs = {"text": body.input, "voice": await registered_voice(served, state, voice)}
    else:
        inputs = speech_inputs(served, body.input, voice)
    if body.instructions:
        inputs["instruct"] = body.instructions
    return inputs


def _check_unsupported(body: SpeechRequest, takes: Any) -> None:
    if body.speed != 1.0:
        raise APIError(
            400,
            f"speed {body.speed} is not supported: speech is served at speed 1.0",
            param="speed",
        )
    if body.instructions and "instruct" not in takes:
        raise APIError(
            400, "instructions are not supported by the served models", param="instructions"
        )


def _extensions(body: SpeechRequest) -> dict[str, Any]:
    return {
        "seed": body.seed,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_tokens": body.max_tokens,
        "repetition_penalty": body.repetition_penalty,
    }


async def _audio(tracked: TrackedRequest, fmt: str, rate: int) -> AsyncGenerator[bytes, None]:
    # An error midway ends the body early (the connection is reset): a client reading audio
    # has no other channel for it.
    encoder = AudioEncoder(fmt)
    try:
        async for item in tracked.outputs():
            if isinstance(item, AudioChunk) and (data := encoder.encode(item)):
                yield data
        if tail := encoder.finish(rate):
            yield tail
    finally:
        await tracked.close()


async def _events(tracked: TrackedRequest, fmt: str, rate: int) -> AsyncGenerator[bytes, None]:
    encoder = AudioEncoder(fmt)
    samples = 0
    try:
        async for item in tracked.outputs():
            if isinstance(item, AudioChunk):
                samples += item.pcm.numel()
                if data := encoder.encode(item):
                    yield sse_event(_delta(data))
        if tail := encoder.finish(rate):
            yield sse_event(_delta(tail))
        yield sse_event(_done(tracked, samples))
    except APIError as exc:
        yield sse_event({"type": "error", **exc.body()})
    finally:
        await tracked.close()


def _delta(data: bytes) -> dict[str, Any]:
    return {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}


def _done(tracked: TrackedRequest, samples: int) -> dict[str, Any]:
    done: dict[str, Any] = {"type": "speech.audio.done", "samples": samples}
    if tracked.end is not None:
        prompt, completion = tracked.end.prompt_tokens, tracked.end.completion_tokens
        done["usage"] = {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return done
