"""A realtime session's conversation: its items in order, as the API shows them and as the
model reads them.

Items are messages (user text or audio, assistant text or spoken text), function calls the
model made and the outputs the client sent back. The model reads the conversation as chat
messages: a user's audio as speech (the encoder's rows when the session heard it as it was
spoken, else its 16 kHz PCM for the request to encode) for a model that hears, else through its
transcript; an assistant's spoken reply as the text it spoke (cut where the client said playback
stopped), a function call as the model's own ``<tool_call>`` text, its output as a ``tool``
message.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mstar_async.realtime.events import RealtimeError, new_id
from mstar_async.realtime.resample import PcmResampler

MAX_ITEMS = 512
MAX_TEXT_CHARS = 32_768
#: The longest audio part ``conversation.item.create`` takes: two minutes, as the input buffer.
MAX_ITEM_AUDIO_S = 120
_CLIENT_RATE = 24_000


@dataclass
class Message:
    """A message; ``text`` is what it says (an audio part's transcript, if known)."""

    role: str
    text: str = ""
    audio: np.ndarray | None = None  # a user's speech, 16 kHz
    rows: torch.Tensor | None = None  # its encoding, when the session heard it while spoken
    spoken: bool = False  # an assistant reply given as audio (its text is the transcript)
    audio_ms: int = 0
    status: str = "completed"
    id: str = field(default_factory=lambda: new_id("item"))

    def as_json(self, *, beta: bool) -> dict[str, Any]:
        """The item as ``conversation.item.*`` events carry it."""
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [self._part(beta)],
        }

    def _part(self, beta: bool) -> dict[str, Any]:
        if self.role == "user":
            if self.audio is not None:
                return {"type": "input_audio", "transcript": self.text or None}
            return {"type": "input_text", "text": self.text}
        if self.spoken:
            return {"type": "audio" if beta else "output_audio", "transcript": self.text}
        return {
            "type": "text" if beta or self.role == "system" else "output_text",
            "text": self.text,
        }


@dataclass
class FunctionCall:
    """A call the model made to one of the session's tools."""

    name: str
    arguments: str
    call_id: str = field(default_factory=lambda: new_id("call"))
    status: str = "completed"
    id: str = field(default_factory=lambda: new_id("item"))

    def as_json(self, *, beta: bool) -> dict[str, Any]:
        """The item as events carry it."""
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "function_call",
            "status": self.status,
            "name": self.name,
            "call_id": self.call_id,
            "arguments": self.arguments,
        }


@dataclass
class FunctionOutput:
    """The client's result of a function call."""

    call_id: str
    output: str
    id: str = field(default_factory=lambda: new_id("item"))

    def as_json(self, *, beta: bool) -> dict[str, Any]:
        """The item as events carry it."""
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "function_call_output",
            "status": "completed",
            "call_id": self.call_id,
            "output": self.output,
        }


Item = Message | FunctionCall | FunctionOutput


class Conversation:
    """The items of one session, in order. Synchronous; errors are ``RealtimeError``s."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    @property
    def last_id(self) -> str | None:
        """The id of the newest item (the ``previous_item_id`` of the next one)."""
        return self.items[-1].id if self.items else None

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (``"root"``: first; None: last); returns
        the id of the item before it.

        Raises:
            RealtimeError: the previous item is unknown, the id is taken, or the conversation
                is full.
        """
        if len(self.items) >= MAX_ITEMS:
            raise RealtimeError(
                f"the conversation holds {MAX_ITEMS} items, the most it may; delete some first",
                code="conversation_full",
            )
        if any(existing.id == item.id for existing in self.items):
            raise RealtimeError(f"item id {item.id!r} is already used", param="item.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def append_reply(self, item: Item) -> list[str]:
        """Append an item of the model's reply, making room by dropping the oldest items when
        the conversation is full (a reply is never lost for want of room, as the API's own
        truncation drops the oldest turns); returns the ids dropped. Never raises."""
        dropped = []
        while len(self.items) >= MAX_ITEMS:
            dropped.append(self.items.pop(0).id)
        self.items.append(item)
        return dropped

    def index(self, item_id: str, param: str = "item_id") -> int:
        """Where ``item_id`` is.

        Raises:
            RealtimeError: no such item (``code: item_not_found``).
        """
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise RealtimeError(
            f"no item {item_id!r} in the conversation", code="item_not_found", param=param
        )

    def delete(self, item_id: str) -> None:
        """Remove an item.

        Raises:
            RealtimeError: as ``index``.
        """
        del self.items[self.index(item_id)]

    def messages(self, instructions: str, *, hears: bool = False) -> list[dict[str, Any]]:
        """The conversation as chat messages for the model, ``instructions`` first; with
        ``hears`` (a model with an audio encoder) a user's audio is a message's ``"audio"``:
        its rows if heard, else its 16 kHz PCM as a float tensor.

        Raises:
            RealtimeError: a user's audio has no transcript and the model cannot hear it.
        """
        out: list[dict[str, Any]] = (
            [{"role": "system", "content": instructions}] if instructions else []
        )
        for item in self.items:
            if isinstance(item, FunctionCall):
                call = json.dumps({"name": item.name, "arguments": _arguments(item.arguments)})
                out.append({"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"})
            elif isinstance(item, FunctionOutput):
                out.append({"role": "tool", "content": item.output})
            elif item.audio is not None and hears:
                speech = item.rows if item.rows is not None else torch.from_numpy(item.audio)
                out.append({"role": item.role, "content": item.text, "audio": speech})
            elif item.audio is not None and not item.text:
                raise RealtimeError(
                    f"item {item.id!r} is audio this model cannot hear: it has no audio input "
                    "yet; send the user's words as an input_text item",
                    code="audio_input_unsupported",
                )
            elif item.text:
                out.append({"role": item.role, "content": item.text})
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_item(item: Any) -> Item:
    """A client's ``conversation.item.create`` item.

    Raises:
        RealtimeError: an item type or content this server does not take (names the field).
    """
    if not isinstance(item, dict):
        raise RealtimeError("'item' must be an object", param="item")
    given_id = item.get("id")
    if given_id is not None and (not isinstance(given_id, str) or not 1 <= len(given_id) <= 64):
        raise RealtimeError("item.id must be a string of 1 to 64 characters", param="item.id")
    parsed = _parse_kind(item, item.get("type", "message"))
    if given_id:
        parsed.id = given_id
    return parsed


def _parse_kind(item: dict[str, Any], kind: Any) -> Item:
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if (
            not isinstance(call_id, str)
            or not isinstance(output, str)
            or len(output) > MAX_TEXT_CHARS
        ):
            raise RealtimeError(
                "a function_call_output item needs 'call_id' and 'output' strings "
                f"(output at most {MAX_TEXT_CHARS} characters)",
                param="item",
            )
        return FunctionOutput(call_id, output)
    if kind == "function_call":
        name, arguments, call_id = (
            item.get("name"),
            item.get("arguments", "{}"),
            item.get("call_id"),
        )
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise RealtimeError(
                "a function_call item needs 'name' and 'arguments' strings", param="item"
            )
        call = FunctionCall(name, arguments)
        if isinstance(call_id, str):
            call.call_id = call_id
        return call
    if kind != "message":
        raise RealtimeError(
            f"item.type {kind!r} is not served; use message, function_call or function_call_output",
            param="item.type",
        )
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise RealtimeError("item.role must be user, assistant or system", param="item.role")
    content = item.get("content")
    audio = _content_audio(content)
    if audio is not None and role != "user":
        raise RealtimeError("only a user item may carry input_audio audio", param="item.role")
    return Message(role, _content_text(content), audio=audio)


def _content_audio(content: Any) -> np.ndarray | None:
    """A user item's ``input_audio`` part with ``audio`` (base64 pcm16 at 24 kHz) as 16 kHz
    samples; None when it has none. Its length is checked before it is decoded.

    Raises:
        RealtimeError: more than one audio part, audio that is not base64, or longer than
            ``MAX_ITEM_AUDIO_S`` (names the part and the fix).
    """
    if not isinstance(content, list):
        return None
    parts = [
        (i, part)
        for i, part in enumerate(content)
        if isinstance(part, dict) and part.get("type") == "input_audio" and "audio" in part
    ]
    if not parts:
        return None
    if len(parts) > 1:
        raise RealtimeError("an item takes one input_audio part", param="item.content")
    i, part = parts[0]
    data = part["audio"]
    limit = MAX_ITEM_AUDIO_S * _CLIENT_RATE * 2
    if not isinstance(data, str) or len(data) * 3 // 4 > limit + 2:
        raise RealtimeError(
            f"item.content[{i}].audio must be base64 pcm16 at 24 kHz, at most "
            f"{MAX_ITEM_AUDIO_S} s; send longer speech through input_audio_buffer",
            param=f"item.content[{i}].audio",
        )
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(
            f"item.content[{i}].audio is not valid base64", param=f"item.content[{i}].audio"
        ) from None
    resampler = PcmResampler()
    samples = np.concatenate([resampler.push(pcm), resampler.flush()])
    if samples.size < 1_600:
        raise RealtimeError(
            f"item.content[{i}].audio holds {samples.size // 16} ms; send at least 100 ms",
            param=f"item.content[{i}].audio",
        )
    return samples


def _content_text(content: Any) -> str:
    if not isinstance(content, list) or not content:
        raise RealtimeError("item.content must be a non-empty list of parts", param="item.content")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "input_audio" and isinstance(part.get("audio"), str):
            continue  # speech (see _content_audio)
        elif kind in ("input_audio", "audio", "output_audio") and isinstance(
            part.get("transcript"), str
        ):
            texts.append(part["transcript"])
        else:
            raise RealtimeError(
                f"item.content[{i}]: give a text part ({{'type': 'input_text', 'text': ...}}) "
                "or an input_audio part with 'audio' (base64 pcm16, 24 kHz) or a 'transcript'",
                param=f"item.content[{i}]",
            )
    text = "".join(texts)
    if len(text) > MAX_TEXT_CHARS:
        raise RealtimeError(
            f"an item's text may be at most {MAX_TEXT_CHARS} characters", param="item.content"
        )
    return text
