"""Which served models speak, and how an OpenAI speech request becomes their program's inputs.

A model speaks when its ``info`` declares a ``sample_rate`` and its program takes ``text``;
``info["voice_input"]`` names the program input the OpenAI ``voice`` goes to (``voice`` for
orpheus, ``speaker`` for qwen3-omni) and ``info["voices"]`` lists the valid ones. A program
that takes ``speak`` (qwen3-omni) gets ``speak=True``.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from mstar_async.server.errors import APIError
from mstar_async.server.served import ServedModel

#: OpenAI's ``response_format`` (speech) / ``audio.format`` (chat) -> ``mstar_async.audio`` format.
AUDIO_FORMATS = {
    "wav": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "opus": "opus",
    "pcm": "pcm_s16le",
    "pcm16": "pcm_s16le",
}
MEDIA_TYPES = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "pcm": "audio/pcm",
    "pcm16": "audio/pcm",
}
#: Sampling fields a speech request may pass on when the model's program takes them.
EXTENSIONS = ("seed", "temperature", "top_p", "max_tokens", "repetition_penalty")


class VoiceID(Struct):
    """OpenAI's custom-voice object ``{"id": ...}``."""

    id: str


def voice_name(voice: str | VoiceID | None) -> str | None:
    """The voice's name, whether given as a string or as ``{"id": ...}``."""
    return voice.id if isinstance(voice, VoiceID) else voice


def audio_format(name: str, *, allowed: tuple[str, ...], param: str) -> str:
    """The ``mstar_async.audio`` format for OpenAI format ``name``.

    Raises:
        APIError: 400 naming ``param`` and the supported formats.
    """
    if name not in allowed:
        raise APIError(
            400,
            f"{param} {name!r} is not supported; supported: {', '.join(allowed)}",
            param=param,
        )
    return AUDIO_FORMATS[name]


def sample_rate(served: ServedModel) -> int:
    """The sample rate the model's audio comes at.

    Raises:
        APIError: 400 (``param: "model"``) when the model does not speak.
    """
    if not served.speaks:
        raise APIError(
            400,
            f"model {served.name!r} does not make speech from text; serve a speech model "
            "(orpheus, qwen3-omni) and name it",
            param="model",
        )
    return int(served.runtime.model.info["sample_rate"])


def speech_inputs(
    served: ServedModel, text: str, voice: str | None, *, voice_param: str = "voice"
) -> dict[str, Any]:
    """Program inputs that speak ``text`` in ``voice`` (None: the model's default voice).

    Raises:
        APIError: 400 when the model does not speak (``param: "model"``) or does not have the
            voice (``param`` ``voice_param``, naming the voices it has).
    """
    sample_rate(served)
    inputs: dict[str, Any] = {"text": text}
    inputs.update(voice_inputs(served, voice, voice_param=voice_param))
    return inputs


def voice_inputs(
    served: ServedModel, voice: str | None, *, voice_param: str = "voice"
) -> dict[str, Any]:
    """The inputs choosing ``voice`` (and turning speech on) for a model that speaks.

    Raises:
        APIError: 400 naming ``voice_param`` when the model lacks the voice.
    """
    info = served.runtime.model.info
    inputs: dict[str, Any] = {}
    if "speak" in served.inputs:
        inputs["speak"] = True
    if voice is None:
        return inputs
    voices = [str(v) for v in info.get("voices", ())]
    if voices and voice.lower() not in voices:
        raise APIError(
            400,
            f"model {served.name!r} has no voice {voice!r}; its voices: {', '.join(voices)}",
            param=voice_param,
        )
    target = str(info.get("voice_input", "voice"))
    if target in served.inputs:
        inputs[target] = voice.lower()
    return inputs


def extension_inputs(served: ServedModel, given: dict[str, Any]) -> dict[str, Any]:
    """The ``EXTENSIONS`` fields in ``given`` that are set and that the program takes.

    Raises:
        APIError: 400 naming a field the model's program does not take.
    """
    out = {}
    for name in EXTENSIONS:
        value = given.get(name)
        if value is None:
            continue
        if name not in served.inputs:
            raise APIError(400, f"model {served.name!r} takes no {name!r}", param=name)
        out[name] = value
    return out
