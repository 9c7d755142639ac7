"""One realtime session: client events in, server events out, over one served model.

The session keeps the conversation, the input audio buffer (16 kHz, since the last commit or
clear) and the settings. Appended audio is resampled as it arrives and, while server VAD is
on, streamed into the ``silero-vad`` model (one long request per session, batched with every
other session's frames); its probabilities drive the turn detector. At speech start a playing
response is cancelled (barge-in) when ``interrupt_response`` is on; at speech stop the buffer
is committed as a user message and, with ``create_response``, a response starts.

For a model that hears (``hear`` given), the buffer's samples also stream into the model's audio
encoder as the user talks (``hearing.py``): with server VAD as the VAD judges them, so the
encoder holds exactly the turn when the VAD ends it, without VAD as they are appended. A commit
finishes that encoding (what is left is the last partial second) and the user message carries
its rows, which the response's thinker reads in place of its audio placeholders. A model that
can (``warm`` given) also prefills the turn's response while the user speaks (``warm.py``):
the conversation and the turn up to the encoder's last finished row, at most one such request
at a time, none while a response runs; the response resumes from it and never waits for it.

At most one response runs at a time. A response is one request of the model's program over the
conversation; cancelling it (``response.cancel``, barge-in, the client leaving) closes that
request, which frees its KV at once. A model that keeps the conversation's KV between responses
is told when an earlier item changes (truncated, deleted, inserted before others): it rolls
what it keeps back to the change then, and its memory comes back at the event.

Every refused client event is answered with an ``error`` event and the session goes on; a
response that fails (refused admission, a failure midway, or a turn server VAD committed that
the model cannot read) ends as a ``failed`` ``response.done`` with the error in its
``status_details``, which clients take as a failed turn, not a broken session.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import torch
from anyio.abc import TaskGroup

from mstar_async.errors import MstarError
from mstar_async.logs import get_logger
from mstar_async.realtime.audio_buffer import AudioBuffer
from mstar_async.realtime.config import SessionConfig, max_tokens
from mstar_async.realtime.conversation import Conversation, Message, parse_item
from mstar_async.realtime.events import EventNames, RealtimeError, new_id
from mstar_async.realtime.hearing import (
    Hear,
    HeardTurn,
    Hearing,
    UnheardSamples,
    encode_whole,
)
from mstar_async.realtime.resample import PcmResampler
from mstar_async.realtime.response import ResponseRun, Spoken
from mstar_async.realtime.turns import SpeechStarted, SpeechStopped, TurnDetector
from mstar_async.realtime.vad import FRAME, SAMPLE_RATE
from mstar_async.realtime.warm import Warm, Warmer, WarmTurn
from mstar_async.runtime import Runtime

log = get_logger("mstar_async.realtime")

#: One ``input_audio_buffer.append``'s decoded audio: 15 MiB, as the API allows.
MAX_APPEND_BYTES = 15 * 1024 * 1024
#: The least audio a commit takes: 100 ms.
MIN_COMMIT_SAMPLES = SAMPLE_RATE // 10
#: Pieces of audio the VAD may lag behind the client before appends wait (~10 s at 20 ms).
VAD_BACKLOG = 512
_FRAME_MS = FRAME * 1000 / SAMPLE_RATE

Send = Callable[[dict[str, Any] | None], Awaitable[None]]
#: Starts one response request: (conversation messages, response settings) -> model outputs.
Respond = Callable[[list[dict[str, Any]], SessionConfig], Any]
#: Tells the model the conversation is now these messages (an earlier item changed).
Rewind = Callable[[list[dict[str, Any]]], Awaitable[None]]
#: Committed turns whose hearing a session remembers (``heard``).
HEARD_TURNS = 64


class RealtimeSession:
    """Serves one websocket's session; ``handle`` each client event (a decoded JSON object).

    ``respond(messages, config)`` is an async context manager factory yielding the model's
    outputs and, after, its usage (see ``server.realtime``); ``vad`` the runtime of the
    ``silero-vad`` model, or None when server VAD is not available; ``hear`` starts an encoder
    request of the served model (None: the model hears nothing, and committed speech without a
    transcript cannot be answered); ``on_heard`` is told how each committed turn was heard;
    ``forget`` frees what the model kept of the conversation, once the session has ended and
    its last response is closed; ``rewind(messages)`` rolls what it kept back to where the
    conversation, now ``messages``, changed; ``warm`` prefills a spoken turn while it is
    spoken (see ``warm.py``; only with ``hear``).
    """

    def __init__(
        self,
        send: Send,
        respond: Respond,
        *,
        model: str,
        model_rate: int,
        vad: Runtime | None,
        beta: bool,
        config: SessionConfig,
        hear: Hear | None = None,
        on_heard: Callable[[HeardTurn], None] | None = None,
        forget: Callable[[], Awaitable[None]] | None = None,
        rewind: Rewind | None = None,
        warm: Warm | None = None,
        session_id: str | None = None,
    ) -> None:
        self.id = session_id or new_id("sess")
        self.warm = warm if hear is not None else None
        self.warmer: Warmer | None = None
        self.forget = forget
        self.rewind = rewind
        # The system message the model's kept conversation starts with (the last response's).
        self._kept_system: str | None = None
        self.hear = hear
        self.on_heard = on_heard
        self.hearing: Hearing | None = None
        self.unheard = UnheardSamples()  # appended, not yet judged by the VAD
        self.heard: deque[HeardTurn] = deque(maxlen=HEARD_TURNS)
        self._hearings = 0
        self._vad_frames = 0
        self._vad_origin = 0  # the timeline sample the VAD's stream starts at
        self.send = send
        self.respond = respond
        self.model = model
        self.model_rate = model_rate
        self.vad = vad
        self.names = EventNames(beta)
        self.config = config if vad is not None else replace(config, turn_detection=None)
        self.conversation = Conversation()
        self.spoken: dict[str, Spoken] = {}
        self.resampler = PcmResampler()
        self.buffer = AudioBuffer()
        self.pending_item: str | None = None  # the user item a detected turn will commit
        self.turns = (
            None
            if self.config.turn_detection is None
            else TurnDetector(self.config.turn_detection, _FRAME_MS)
        )
        self.response: ResponseRun | None = None
        self._response_scope: anyio.CancelScope | None = None
        self._response_ended = anyio.Event()
        self._cancel_reason = "client_cancelled"
        self._vad_in: Any = None
        self._tg: TaskGroup | None = None

    def event(self, name: str, /, **fields: Any) -> dict[str, Any] | None:
        """A server event in this session's dialect."""
        return self.names.event(name, **fields)

    # --- running ---------------------------------------------------------------------------

    async def run(self, events: AsyncIterator[Any]) -> None:
        """Serve ``events`` (decoded client events) until they end; then stop what runs.
        Cancel-safe: a response in flight is closed and its request released, then what the
        model kept of the conversation is freed (shielded)."""
        await self.send(self.event("session.created", session=self._session_json()))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.warm is not None:
                    self.warmer = Warmer(self.warm, tg, self._warm_prompt, f"{self.id}-warm")
                async for event in events:
                    await self.handle(event)
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            if self._vad_in is not None:
                self._vad_in.close()
            if self.hearing is not None:
                self.hearing.cancel()
            if self.forget is not None:
                # After the task group: every response is released, so nothing retains the
                # conversation again after this.
                with anyio.CancelScope(shield=True):
                    await self.forget()

    async def handle(self, event: Any) -> None:
        """Act on one client event; a refused one becomes an ``error`` event."""
        event_id = event.get("event_id") if isinstance(event, dict) else None
        try:
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError(
                    "a client event is a JSON object with a string 'type'", param="type"
                )
            handler = _HANDLERS.get(event["type"])
            if handler is None:
                raise RealtimeError(
                    f"unknown event type {event['type']!r}; see the Realtime API's client events",
                    code="unknown_event",
                    param="type",
                )
            await handler(self, event)
        except RealtimeError as refused:
            refused.event_id = refused.event_id or (event_id if isinstance(event_id, str) else None)
            await self.send(self.event("error", error=refused.body()))

    # --- session -----------------------------------------------------------------------------

    def _session_json(self) -> dict[str, Any]:
        return self.config.as_json(beta=self.names.beta, session_id=self.id, model=self.model)

    async def _update(self, event: dict[str, Any]) -> None:
        config = self.config.update(event.get("session"))
        if config.turn_detection is not None and self.vad is None:
            raise RealtimeError(
                "server VAD is not available on this server (install silero-vad); set "
                "turn_detection to null and commit the input audio buffer yourself",
                param="session.turn_detection",
                code="unsupported_value",
            )
        self.config = config
        if config.turn_detection is None:
            self.turns = None
        elif self.turns is None or self.turns.settings != config.turn_detection:
            elapsed = self.turns.elapsed_ms if self.turns is not None else None
            self.turns = TurnDetector(config.turn_detection, _FRAME_MS)
            if elapsed:
                self.turns._elapsed_ms = float(elapsed)
        await self.send(self.event("session.updated", session=self._session_json()))

    # --- input audio ---------------------------------------------------------------------------

    async def _append(self, event: dict[str, Any]) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str) or len(audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
            raise RealtimeError(
                f"'audio' must be base64 pcm16 of at most {MAX_APPEND_BYTES} bytes", param="audio"
            )
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("'audio' is not valid base64", param="audio") from None
        samples = self.resampler.push(pcm)
        self.buffer.append(samples)
        if not samples.size:
            return
        if self.hear is not None:
            self.unheard.push(samples)
        if self.turns is not None:
            await self._to_vad(samples)
        else:  # no VAD to wait for: the encoder hears what is appended
            await self._hear(self.unheard.until(self.buffer.start + self.buffer.samples))

    async def _hear(self, samples: np.ndarray) -> None:
        """Feed the encoder the buffer's next samples, starting a hearing for the turn."""
        if self.hear is None or not samples.size:
            return
        if self.hearing is None:
            assert self._tg is not None
            self._hearings += 1
            name = f"{self.id}-hear-{self._hearings}"
            self.hearing = Hearing(self.hear, self._tg, name, on_rows=self._warm_soon)
            self._warm_soon()  # the conversation and the turn's opening, while it is spoken
        await self.hearing.feed(samples)

    def _warm_soon(self) -> None:
        """The turn being heard, or the conversation before it, changed: warm it again."""
        if self.warmer is not None:
            self.warmer.want()

    def _warm_prompt(self) -> WarmTurn | None:
        """What to prefill now: the conversation, then the turn being heard with the rows its
        encoder has finished; None while a response runs (the warm would compete with it, and
        its reply is not in the conversation yet) or when no turn is being heard."""
        if self.response is not None or self.hearing is None:
            return None
        try:
            messages = self.conversation.messages(_system(self.config), hears=True)
        except RealtimeError:
            return None
        rows = self.hearing.rows
        heard = torch.zeros(0, 0) if rows is None else rows
        turn = {"role": "user", "content": "", "audio": heard}  # as the commit will add it
        return WarmTurn([*messages, turn], self.config)

    async def _finish_hearing(self, samples: int) -> torch.Tensor | None:
        """The rows of the ``samples`` just taken from the buffer (None: the response encodes
        them); records how far the encoder had got when the turn ended."""
        hearing, self.hearing = self.hearing, None
        if hearing is None:
            return None
        await hearing.feed(self.unheard.until(self.buffer.start))  # what the VAD had not judged
        if hearing.fed != samples:  # not the turn's samples (cannot happen; be safe)
            hearing.cancel()
            return None
        at_end = hearing.frames
        rows = await hearing.finish()
        turn = HeardTurn(samples, samples // 160, at_end, 0 if rows is None else rows.shape[0])
        self.heard.append(turn)
        log.info(
            "realtime.turn_heard",
            session=self.id,
            seconds=samples / SAMPLE_RATE,
            unheard_s=turn.unheard_s,
            rows=turn.rows,
        )
        if self.on_heard is not None:
            self.on_heard(turn)
        return rows

    async def _to_vad(self, samples: np.ndarray) -> None:
        if self._vad_in is None:
            assert self._tg is not None and self.vad is not None
            send, receive = anyio.create_memory_object_stream[torch.Tensor](VAD_BACKLOG)
            self._vad_in = send
            self._vad_origin = self.buffer.start + self.buffer.samples - samples.size
            self._tg.start_soon(self._listen, self.vad, receive)
        await self._vad_in.send(torch.from_numpy(samples))

    async def _listen(self, vad: Runtime, receive: Any) -> None:
        async def audio() -> AsyncIterator[torch.Tensor]:
            async with receive:
                async for piece in receive:
                    yield piece

        try:
            async with vad.generate(audio=audio(), request_id=f"{self.id}-vad") as probabilities:
                async for probability in probabilities:
                    # The encoder hears what the VAD has judged, so that at a turn's end it
                    # holds exactly the turn.
                    self._vad_frames += 1
                    judged = self._vad_origin + self._vad_frames * FRAME
                    await self._hear(self.unheard.until(judged))
                    if self.turns is None:
                        continue
                    turn = self.turns.frame(probability)
                    try:
                        if isinstance(turn, SpeechStarted):
                            await self._speech_started(turn)
                        elif isinstance(turn, SpeechStopped):
                            await self._speech_stopped(turn)
                    except RealtimeError as refused:  # no client event to answer: report it
                        await self.send(self.event("error", error=refused.body()))
        except MstarError as exc:  # the VAD failed: the session goes on with manual commits
            log.error("realtime.vad_failed", session=self.id, error=repr(exc))
            self.turns = None
            failed = RealtimeError(
                f"server VAD stopped ({exc}); commit the input audio buffer yourself",
                code="vad_failed",
                kind="server_error",
            )
            await self.send(self.event("error", error=failed.body()))

    async def _speech_started(self, turn: SpeechStarted) -> None:
        self.pending_item = new_id("item")
        await self.send(
            self.event(
                "input_audio_buffer.speech_started",
                audio_start_ms=turn.audio_start_ms,
                item_id=self.pending_item,
            )
        )
        detection = self.config.turn_detection
        if self.response is not None and detection is not None and detection.interrupt_response:
            self._cancel_response("turn_detected")

    async def _speech_stopped(self, turn: SpeechStopped) -> None:
        item_id = self.pending_item or new_id("item")
        self.pending_item = None
        await self.send(
            self.event(
                "input_audio_buffer.speech_stopped", audio_end_ms=turn.audio_end_ms, item_id=item_id
            )
        )
        end = self.buffer.samples_until(turn.audio_end_ms)
        if end < MIN_COMMIT_SAMPLES:
            return  # a buffer cleared mid-turn: nothing of the turn is left
        await self._commit(item_id, end)
        detection = self.config.turn_detection
        if detection is not None and detection.create_response and self.response is None:
            await self._create_response({}, server=True)

    async def _commit_event(self, event: dict[str, Any]) -> None:
        if self.buffer.samples < MIN_COMMIT_SAMPLES:
            raise RealtimeError(
                f"buffer too small: it holds {self.buffer.samples * 1000 // SAMPLE_RATE} ms of "
                "audio, a commit needs at least 100 ms",
                code="input_audio_buffer_commit_empty",
            )
        await self._commit(self.pending_item or new_id("item"), self.buffer.samples)
        self.pending_item = None

    async def _commit(self, item_id: str, samples: int) -> None:
        if self.warmer is not None:
            self.warmer.stop()  # what it warmed stays, for the response to resume from
        audio = self.buffer.take(samples)
        rows = await self._finish_hearing(audio.size)
        message = Message("user", audio=audio, rows=rows, id=item_id)
        previous = self.conversation.add(message)
        await self.send(
            self.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        )
        await self.send(
            self.event(
                "conversation.item.added",
                previous_item_id=previous,
                item=message.as_json(beta=self.names.beta),
            )
        )
        await self.send(
            self.event(
                "conversation.item.done",
                previous_item_id=previous,
                item=message.as_json(beta=self.names.beta),
            )
        )

    async def _clear(self, event: dict[str, Any]) -> None:
        self.buffer.take(self.buffer.samples)
        if self.hearing is not None:
            self.hearing.cancel()
            self.hearing = None
        if self.warmer is not None:
            self.warmer.discard()  # the turn it warmed is gone
        self.unheard.drop(self.buffer.start)
        if self.turns is not None:
            self.turns.reset()
        self.pending_item = None
        await self.send(self.event("input_audio_buffer.cleared"))

    # --- conversation --------------------------------------------------------------------------

    async def _item_create(self, event: dict[str, Any]) -> None:
        item = parse_item(event.get("item"))
        previous = event.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise RealtimeError("previous_item_id must be a string", param="previous_item_id")
        before = self.conversation.add(item, previous)
        inserted = self.conversation.items[-1] is not item
        if isinstance(item, Message) and item.audio is not None and self.hear is not None:
            # Encoded once, here: every later turn reads the same rows, so the model's kept
            # conversation matches them (a response encoding it each time might round
            # differently in another batch).
            self._hearings += 1
            name = f"{self.id}-item-{self._hearings}"
            item.rows = await encode_whole(self.hear, item.audio, name)
        body = item.as_json(beta=self.names.beta)
        await self.send(self.event("conversation.item.added", previous_item_id=before, item=body))
        await self.send(self.event("conversation.item.done", previous_item_id=before, item=body))
        if inserted:
            await self._rewind()
        self._warm_soon()

    async def _item_delete(self, event: dict[str, Any]) -> None:
        item_id = _string(event, "item_id")
        self.conversation.delete(item_id)
        self.spoken.pop(item_id, None)
        await self.send(self.event("conversation.item.deleted", item_id=item_id))
        await self._rewind()
        self._warm_soon()

    async def _rewind(self) -> None:
        """An earlier item changed: the model rolls what it keeps of the conversation back to
        the change now, so its memory comes back at the event (the next response would roll
        it back anyway; ``resume`` never serves stale context). Nothing to do for a model that
        keeps nothing, or before any response; a conversation the model cannot read is left
        to the next response, which reports it."""
        if self.rewind is None or self._kept_system is None:
            return
        try:
            messages = self.conversation.messages(self._kept_system, hears=self.hear is not None)
        except RealtimeError:
            return
        await self.rewind(messages)

    async def _item_truncate(self, event: dict[str, Any]) -> None:
        item_id = _string(event, "item_id")
        end_ms = event.get("audio_end_ms")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise RealtimeError("audio_end_ms must be an integer >= 0", param="audio_end_ms")
        if self.response is not None and self.response.message.id == item_id:
            # The reply still being made (or ending after a barge-in): stop it and wait until
            # it has ended, so the item is in the conversation and the model has kept it.
            self._cancel_response("client_cancelled")
            await self._response_ended.wait()
        item = self.conversation.items[self.conversation.index(item_id)]
        if not (isinstance(item, Message) and item.role == "assistant" and item.spoken):
            raise RealtimeError(
                "only an assistant message with audio can be truncated", param="item_id"
            )
        if end_ms > item.audio_ms:
            raise RealtimeError(
                f"audio_end_ms {end_ms} is past the item's {item.audio_ms} ms of audio",
                param="audio_end_ms",
            )
        spoken = self.spoken.get(item_id)
        item.text = item.text[: spoken.text_heard(end_ms)] if spoken is not None else ""
        item.audio_ms = end_ms
        await self.send(
            self.event(
                "conversation.item.truncated",
                item_id=item_id,
                content_index=event.get("content_index", 0),
                audio_end_ms=end_ms,
            )
        )
        # What the model kept past the text the user heard goes back to the pool now.
        await self._rewind()
        self._warm_soon()

    # --- responses -----------------------------------------------------------------------------

    async def _response_create(self, event: dict[str, Any]) -> None:
        await self._create_response(event.get("response") or {})

    async def _create_response(self, overrides: Any, *, server: bool = False) -> None:
        """Start a response over the conversation.

        A client's ``response.create`` that cannot start raises (the client gets an ``error``
        event naming its event); one the server starts itself (``server``: a turn server VAD
        detected) that cannot start is announced and ended at once as a ``failed`` response,
        the API's way of reporting a response's failure, which clients take as such and go on.

        Raises:
            RealtimeError: a client's response that cannot start (another is active, a bad
                override, a conversation the model cannot read).
        """
        if self.response is not None:
            raise RealtimeError(
                f"the conversation already has an active response {self.response.id}; "
                "wait for response.done or send response.cancel",
                code="conversation_already_has_active_response",
            )
        config, metadata = _response_config(self.config, overrides)
        try:
            messages = self.conversation.messages(_system(config), hears=self.hear is not None)
        except RealtimeError as refused:
            if not server:
                raise
            failed = ResponseRun(self.names, config, self.send, self.model_rate)
            await failed.start()
            await failed.finish("failed", refused.code, {}, error=refused.body())
            return
        run = ResponseRun(self.names, config, self.send, self.model_rate, metadata=metadata)
        self.response = run
        if self.warmer is not None:
            # The response resumes from what was warmed so far and does not wait for more.
            self.warmer.stop()
        self._response_ended = anyio.Event()
        self._kept_system = _system(config)
        self._cancel_reason = "client_cancelled"
        scope = anyio.CancelScope()
        self._response_scope = scope
        await run.start()
        assert self._tg is not None
        self._tg.start_soon(self._run_response, run, messages, config, scope)

    async def _run_response(
        self,
        run: ResponseRun,
        messages: list[dict[str, Any]],
        config: SessionConfig,
        scope: anyio.CancelScope,
    ) -> None:
        status, reason, usage = "completed", None, {}
        error: dict[str, Any] | None = None
        previous = self.conversation.last_id
        ended = self._response_ended  # this response's: the next one makes its own
        try:
            with scope:
                async with self.respond(messages, config) as reply:
                    async for output in reply.outputs():
                        await run.output(output, previous)
                    usage = reply.usage()
            if scope.cancelled_caught:
                status, reason = "cancelled", self._cancel_reason
        except RealtimeError as refused:
            # Refused admission (the model's in-flight bound) or a failure midway: the
            # response ends as failed, the error in its status_details, as the API reports a
            # response's failure (an ``error`` event is for a client event the server refuses).
            status, reason, error = "failed", refused.code, refused.body()
        finally:
            with anyio.CancelScope(shield=True):
                for item in run.items:
                    for gone in self.conversation.append_reply(item):
                        self.spoken.pop(gone, None)
                if run.message.spoken:
                    self.spoken[run.message.id] = run.spoken
                self.response = None
                self._response_scope = None
                self._warm_next()
                await run.finish(status, reason, usage, error=error)
                ended.set()

    def _warm_next(self) -> None:
        """A response ended: warm the turn being heard now (the reply is in the conversation),
        or, with none, drop what was warmed (the answered turn's, which the conversation's
        own kept KV now holds)."""
        if self.warmer is None:
            return
        if self.hearing is not None:
            self.warmer.want()
        else:
            self.warmer.discard()

    def _cancel_response(self, reason: str) -> None:
        if self._response_scope is not None:
            self._cancel_reason = reason
            self._response_scope.cancel()

    async def _response_cancel(self, event: dict[str, Any]) -> None:
        wanted = event.get("response_id")
        if self.response is None or (wanted is not None and wanted != self.response.id):
            which = "no active response" if wanted is None else f"no active response {wanted!r}"
            raise RealtimeError(f"there is {which} to cancel", code="response_cancel_not_active")
        self._cancel_response("client_cancelled")

    async def _item_retrieve(self, event: dict[str, Any]) -> None:
        item_id = _string(event, "item_id")
        try:
            item = self.conversation.items[self.conversation.index(item_id)]
        except RealtimeError as missing:
            missing.code = "item_retrieve_invalid_item_id"
            raise
        await self.send(
            self.event("conversation.item.retrieved", item=item.as_json(beta=self.names.beta))
        )

    async def _unsupported(self, event: dict[str, Any]) -> None:
        raise RealtimeError(
            f"{event['type']} is not served here: {_UNSUPPORTED[event['type']]}",
            code="unsupported_event",
            param="type",
        )


def _string(event: dict[str, Any], name: str) -> str:
    value = event.get(name)
    if not isinstance(value, str):
        raise RealtimeError(f"'{name}' must be a string", param=name)
    return value


#: ``response.create`` fields that set the response's own settings, as ``session.update`` would.
_RESPONSE_SETTINGS = (
    "instructions",
    "output_modalities",
    "modalities",
    "tools",
    "tool_choice",
    "temperature",
    "voice",
    "output_audio_format",
)
MAX_METADATA_PAIRS = 16


def _response_config(
    config: SessionConfig, overrides: Any
) -> tuple[SessionConfig, dict[str, str] | None]:
    """The settings one response runs with, and the ``metadata`` it carries back.

    Raises:
        RealtimeError: a bad field, or an out-of-band response (``conversation: "none"``,
            ``input``), which this server does not run.
    """
    if not isinstance(overrides, dict):
        raise RealtimeError("'response' must be an object", param="response")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides.get("conversation", "auto") != "auto" or "input" in overrides:
        param = "response.input" if "input" in overrides else "response.conversation"
        raise RealtimeError(
            "out-of-band responses (conversation 'none', or an 'input' list) are not served; "
            "a response reads the session's conversation",
            param=param,
            code="unsupported_value",
        )
    changes = {k: v for k, v in overrides.items() if k in _RESPONSE_SETTINGS}
    audio = overrides.get("audio")
    if isinstance(audio, dict) and isinstance(audio.get("output"), dict):
        changes["audio"] = {"output": audio["output"]}  # a response has no input settings
    updated = config.update(changes)
    for name in ("max_output_tokens", "max_response_output_tokens"):
        if name in overrides:
            updated = replace(updated, max_output_tokens=max_tokens(overrides[name], name))
    return updated, _metadata(overrides.get("metadata"))


def _metadata(value: Any) -> dict[str, str] | None:
    """A response's ``metadata``: at most 16 string pairs (keys up to 64 characters, values up
    to 512), given back on the response object.

    Raises:
        RealtimeError: anything else.
    """
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise RealtimeError(
            f"response.metadata must be at most {MAX_METADATA_PAIRS} string pairs (keys up to "
            "64 characters, values up to 512)",
            param="response.metadata",
        )
    return dict(value)


def _system(config: SessionConfig) -> str:
    """The instructions, with the tools described where the session declares any."""
    if not config.tools or config.tool_choice == "none":
        return config.instructions
    signatures = "\n".join(json.dumps(tool) for tool in config.tools)
    return (
        f"{config.instructions}\n\nThese functions are available:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call one, write its name and JSON arguments between tags, on their own lines:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
    ).strip()


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession._update,
    "input_audio_buffer.append": RealtimeSession._append,
    "input_audio_buffer.commit": RealtimeSession._commit_event,
    "input_audio_buffer.clear": RealtimeSession._clear,
    "conversation.item.create": RealtimeSession._item_create,
    "conversation.item.delete": RealtimeSession._item_delete,
    "conversation.item.truncate": RealtimeSession._item_truncate,
    "response.create": RealtimeSession._response_create,
    "response.cancel": RealtimeSession._response_cancel,
    "conversation.item.retrieve": RealtimeSession._item_retrieve,
}
#: Client events of the API this server knows and does not serve, and why.
_UNSUPPORTED = {
    "output_audio_buffer.clear": "the output audio buffer belongs to WebRTC and SIP connections; "
    "over a websocket the client plays the audio itself: stop playback, send response.cancel "
    "and conversation.item.truncate",
    "transcription_session.update": "transcription-only sessions are not served",
}
_HANDLERS.update(dict.fromkeys(_UNSUPPORTED, RealtimeSession._unsupported))
