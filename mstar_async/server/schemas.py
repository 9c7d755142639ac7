"""Request bodies, validated by msgspec: a bad field becomes a 400 naming it.

Unknown fields are ignored (clients send extensions freely); fields the server cannot honour
are declared and refused explicitly (``n`` other than 1).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from mstar_async.server.errors import APIError
from mstar_async.server.speech_models import VoiceID

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
#: > 0, 1 off: a repeated token's logit divided by it (multiplied where negative).
RepetitionPenalty = Annotated[float, Meta(gt=0.0)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(Struct):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class ChatMessage(Struct):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Struct):
    """``include_usage``: send a last chunk carrying the token counts."""

    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Fields shared by chat completions and completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: PositiveInt = 1
    ignore_eos: bool = False
    user: str | None = None


class ChatAudio(Struct):
    """``audio`` of a chat completion: the voice and the format of the spoken reply."""

    voice: str | VoiceID
    format: str


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[str]


class SpeechRequest(Struct, kw_only=True):
    """``POST /v1/audio/speech``; ``seed``, ``temperature``, ``top_p``, ``max_tokens`` and
    ``repetition_penalty`` are extensions passed to the model when its program takes them."""

    model: str
    input: Annotated[str, Meta(min_length=1)]  # its length limit is the model's (limits.py)
    voice: str | VoiceID | None = None
    response_format: str = "wav"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: PositiveInt | None = None
    repetition_penalty: RepetitionPenalty | None = None
    #: One-off cloning (models that clone voices): base64 of a reference recording, and
    #: what it says (without it, the speaker embedding alone is used).
    ref_audio: str | None = None
    ref_text: str | None = None


class ImageRequest(Struct, kw_only=True):
    """``POST /v1/images/generations``; ``steps`` and ``seed`` are extensions."""

    model: str
    prompt: Annotated[str, Meta(min_length=1)]
    n: PositiveInt = 1
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    steps: PositiveInt | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None


class GenerateRequest(Struct, kw_only=True):
    """``POST /generate``: the model's program inputs, as they are."""

    model: str
    inputs: dict[str, Any] = msgspec.field(default_factory=dict)
    format: Literal["sse", "ndjson"] = "sse"


T = TypeVar("T")


def decode(body: bytes | str, kind: type[T]) -> T:
    """``body`` (JSON) as a ``kind``.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: the body does not fit (the app answers
            400 naming the field).
        APIError: 400, the JSON is nested deeper than the decoder follows.
    """
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except RecursionError:
        raise APIError(
            400, "the JSON body is nested too deeply; send a flatter document", param="body"
        ) from None
