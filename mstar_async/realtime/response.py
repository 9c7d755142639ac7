"""One model response of a realtime session: the model's outputs as Realtime server events.

A response is one request of the served model's program over the conversation so far. Its text
and audio come as deltas of one assistant message (``response.output_audio_transcript.delta``
and ``response.output_audio.delta`` when the session speaks, ``response.output_text.delta``
otherwise); when the session declares tools and the model writes a ``<tool_call>``, the call
becomes a ``function_call`` item with its arguments' events. ``response.done`` ends every
response, with ``completed``, ``cancelled`` (``response.cancel``, or the user speaking over it)
or ``failed``, and the usage.

While it plays, the response keeps where its text stood at each piece of audio, so a client's
``conversation.item.truncate`` at ``audio_end_ms`` cuts the message's text where the audio was
cut: later turns read only what the user heard.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import soxr

from mstar_async.outputs import AudioChunk, TextDelta
from mstar_async.realtime.config import CLIENT_RATE, SessionConfig
from mstar_async.realtime.conversation import FunctionCall, Message
from mstar_async.realtime.events import EventNames, new_id
from mstar_async.realtime.tool_calls import ToolCallParser

Send = Callable[[dict[str, Any] | None], Awaitable[None]]


@dataclass
class Spoken:
    """How far the text had come at the end of each piece of audio sent (for truncation)."""

    ends_ms: list[float] = field(default_factory=list)
    text_at: list[int] = field(default_factory=list)

    def add(self, end_ms: float, text_len: int) -> None:
        """The audio sent so far ends at ``end_ms``, with ``text_len`` characters of text."""
        self.ends_ms.append(end_ms)
        self.text_at.append(text_len)

    def text_heard(self, audio_end_ms: int) -> int:
        """Characters of text the user heard once ``audio_end_ms`` of audio had played: the
        text made before the first piece of audio that played past that point."""
        i = bisect.bisect_left(self.ends_ms, audio_end_ms)
        return (
            self.text_at[i] if i < len(self.text_at) else (self.text_at[-1] if self.text_at else 0)
        )


class ResponseRun:
    """Turns one request's outputs into events; the session runs ``run`` in a task and
    cancels it to stop the response (``finish`` is then called from the session)."""

    def __init__(
        self,
        names: EventNames,
        config: SessionConfig,
        send: Send,
        model_rate: int,
        *,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.id = new_id("resp")
        self.metadata = metadata
        self.error: dict[str, Any] | None = None
        self.names = names
        self.config = config
        self.send = send
        self.message = Message("assistant", spoken=config.speaks, status="in_progress")
        self.calls: list[FunctionCall] = []
        self.spoken = Spoken()
        self.status = "in_progress"
        self.reason: str | None = None
        self.usage: dict[str, int] = {}
        self._parser = ToolCallParser() if config.tools and config.tool_choice != "none" else None
        self._resampler = (
            None
            if model_rate == CLIENT_RATE
            else soxr.ResampleStream(model_rate, CLIENT_RATE, 1, "float32")
        )
        self._audio_ms = 0.0
        self._opened = False
        self._outputs = 0

    def _event(self, name: str, /, **fields: Any) -> dict[str, Any] | None:
        return self.names.event(name, **fields)

    def response_json(self) -> dict[str, Any]:
        """The response object of ``response.created`` / ``response.done``."""
        output = ([self.message] if self._opened else []) + list(self.calls)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": self._status_details(),
            "output": [item.as_json(beta=self.names.beta) for item in output],
            "usage": self.usage or None,
            "metadata": self.metadata,
        }
        modalities = list(self.config.modalities)
        body["modalities" if self.names.beta else "output_modalities"] = modalities
        return body

    def _status_details(self) -> dict[str, Any] | None:
        if self.reason is None and self.error is None:
            return None
        details: dict[str, Any] = {"type": self.status, "reason": self.reason}
        if self.error is not None:
            details["error"] = self.error
        return details

    async def start(self) -> None:
        """Announce the response."""
        await self.send(self._event("response.created", response=self.response_json()))

    async def _open_message(self, previous_item_id: str | None) -> None:
        self._opened = True
        item = self.message.as_json(beta=self.names.beta)
        item["content"] = []
        await self.send(
            self._event(
                "response.output_item.added", response_id=self.id, output_index=0, item=item
            )
        )
        await self.send(
            self._event("conversation.item.added", previous_item_id=previous_item_id, item=item)
        )
        part = (
            {"type": "audio", "transcript": ""}
            if self.config.speaks
            else {"type": "text", "text": ""}
        )
        await self.send(self._ids("response.content_part.added", part=part))

    def _ids(self, name: str, /, **fields: Any) -> dict[str, Any] | None:
        return self._event(
            name,
            response_id=self.id,
            item_id=self.message.id,
            output_index=0,
            content_index=0,
            **fields,
        )

    async def text(self, delta: str, previous_item_id: str | None) -> None:
        """A piece of the model's text (tool calls taken out where tools are declared)."""
        if self._parser is not None:
            delta, calls = self._parser.push(delta)
            for call in calls:
                await self._call(FunctionCall(call.name, call.arguments))
        if not delta:
            return
        if not self._opened:
            await self._open_message(previous_item_id)
        self.message.text += delta
        name = (
            "response.output_audio_transcript.delta"
            if self.config.speaks
            else "response.output_text.delta"
        )
        await self.send(self._ids(name, delta=delta))

    async def audio(self, chunk: AudioChunk, previous_item_id: str | None) -> None:
        """A piece of the model's speech, resampled to the client's rate, as pcm16."""
        if not self.config.speaks:
            return
        if not self._opened:
            await self._open_message(previous_item_id)
        samples = chunk.pcm.detach().float().cpu().numpy().reshape(-1)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=False)
        if samples.size == 0:
            return
        self._audio_ms += samples.size * 1000 / CLIENT_RATE
        self.message.audio_ms = round(self._audio_ms)
        self.spoken.add(self._audio_ms, len(self.message.text))
        pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        await self.send(
            self._ids("response.output_audio.delta", delta=base64.b64encode(pcm).decode("ascii"))
        )

    async def _call(self, call: FunctionCall) -> None:
        self.calls.append(call)
        index = len(self.calls) - (0 if self._opened else 1)
        item = call.as_json(beta=self.names.beta)
        await self.send(
            self._event(
                "response.output_item.added", response_id=self.id, output_index=index, item=item
            )
        )
        await self.send(self._event("conversation.item.added", previous_item_id=None, item=item))
        ids = {
            "response_id": self.id,
            "item_id": call.id,
            "output_index": index,
            "call_id": call.call_id,
        }
        await self.send(
            self._event("response.function_call_arguments.delta", delta=call.arguments, **ids)
        )
        await self.send(
            self._event(
                "response.function_call_arguments.done",
                arguments=call.arguments,
                name=call.name,
                **ids,
            )
        )
        await self.send(
            self._event(
                "response.output_item.done", response_id=self.id, output_index=index, item=item
            )
        )
        await self.send(self._event("conversation.item.done", item=item))

    async def output(self, item: Any, previous_item_id: str | None) -> None:
        """One output of the model's program."""
        self._outputs += 1
        if isinstance(item, TextDelta):
            await self.text(item.text, previous_item_id)
        elif isinstance(item, AudioChunk):
            await self.audio(item, previous_item_id)

    async def finish(
        self,
        status: str,
        reason: str | None,
        usage: dict[str, int],
        *,
        error: dict[str, Any] | None = None,
    ) -> None:
        """Close the message's parts and send ``response.done`` (a failed response's
        ``status_details`` carries ``error``). The session calls it once per response."""
        self.status, self.reason, self.usage, self.error = status, reason, usage, error
        if self._parser is not None:
            rest = self._parser.flush()
            if rest and status == "completed":
                await self.text(rest, None)
        message = self.message
        message.status = "completed" if status == "completed" else "incomplete"
        if self._opened:
            if self.config.speaks:
                await self.send(self._ids("response.output_audio.done"))
                await self.send(
                    self._ids("response.output_audio_transcript.done", transcript=message.text)
                )
                part = {"type": "audio", "transcript": message.text}
            else:
                await self.send(self._ids("response.output_text.done", text=message.text))
                part = {"type": "text", "text": message.text}
            await self.send(self._ids("response.content_part.done", part=part))
            item = message.as_json(beta=self.names.beta)
            await self.send(
                self._event(
                    "response.output_item.done", response_id=self.id, output_index=0, item=item
                )
            )
            await self.send(self._event("conversation.item.done", item=item))
        await self.send(self._event("response.done", response=self.response_json()))

    @property
    def items(self) -> list[Message | FunctionCall]:
        """What this response adds to the conversation, in order."""
        return ([self.message] if self._opened else []) + list(self.calls)
