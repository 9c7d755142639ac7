"""Incremental text in, speech out segment by segment: one request per segment, in order.

``SentenceSplitter`` cuts pushed text into segments at sentence ends; ``SegmentedSpeech`` runs
each flushed segment as its own request, strictly one after another, and can drop everything
queued and in flight at once (``cancel``). This is the one place that knows how a stream of
text becomes requests; a runtime-level session (push_text / flush / end_input) can replace it
without changing the websocket protocol.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from mstar_async.outputs import AudioChunk
from mstar_async.runtime.session import split_sentences


class SentenceSplitter:
    """Buffers pushed text; hands out each complete sentence, and the rest on ``flush``."""

    def __init__(self) -> None:
        self._pending = ""

    def push(self, text: str) -> list[str]:
        """Add ``text``; return the sentences it completes (stripped, non-empty)."""
        sentences, self._pending = split_sentences(self._pending + text)
        return sentences

    def flush(self) -> str | None:
        """The buffered text as one segment (None when only whitespace is buffered)."""
        text, self._pending = self._pending.strip(), ""
        return text or None

    def clear(self) -> None:
        """Forget the buffered text."""
        self._pending = ""

    @property
    def pending(self) -> str:
        """The buffered text that no sentence end has completed yet."""
        return self._pending

    def restore(self, pending: str) -> None:
        """Make ``pending`` (read before a ``push``) the buffer again: undoes a refused push."""
        self._pending = pending


@dataclass(frozen=True)
class SegmentAudio:
    """A piece of audio of segment ``segment``."""

    segment: int
    chunk: AudioChunk


@dataclass(frozen=True)
class SegmentDone:
    """Segment ``segment`` has been spoken whole."""

    segment: int


#: Speaks one segment: an async generator of its audio, closed (``aclose``) when abandoned.
SpeakFn = Callable[[str], AsyncGenerator[AudioChunk, None]]
#: Receives each event as it happens.
EmitFn = Callable[["SegmentAudio | SegmentDone"], Awaitable[None]]


class SegmentedSpeech:
    """Runs one speech request per segment, in the order segments were queued.

    ``queue(text)`` numbers a segment (0, 1, ...) and returns its number; ``run(emit)`` hands
    ``SegmentAudio`` and ``SegmentDone`` to ``emit`` as segments are spoken and returns after
    ``end_input`` once every queued segment is done. ``cancel`` drops the queued segments and
    cancels the one being spoken (its request is closed, so its memory is freed, before
    ``run`` goes on). Used from one event loop.
    """

    def __init__(self, speak: SpeakFn) -> None:
        self._speak = speak
        self._send: MemoryObjectSendStream[tuple[int, int, str]]
        self._receive: MemoryObjectReceiveStream[tuple[int, int, str]]
        self._send, self._receive = anyio.create_memory_object_stream(math.inf)
        self._next = 0
        self._epoch = 0
        self._current: anyio.CancelScope | None = None

    def queue(self, text: str) -> int:
        """Queue ``text`` as the next segment; return its number.

        Raises:
            anyio.ClosedResourceError: after ``end_input``.
        """
        number, self._next = self._next, self._next + 1
        self._send.send_nowait((self._epoch, number, text))
        return number

    def end_input(self) -> None:
        """No more segments: ``run`` returns after the queued ones."""
        self._send.close()

    def cancel(self) -> None:
        """Drop the queued segments and cancel the one being spoken."""
        self._epoch += 1
        if self._current is not None:
            self._current.cancel()

    async def run(self, emit: EmitFn) -> None:
        """Speak the segments in order, handing their audio and completions to ``emit``.

        Safe to cancel: the request of the segment being spoken is closed first. Raises what a
        segment's request or ``emit`` raises.
        """
        async with self._receive, self._send:  # both closed however the session ends
            async for epoch, number, text in self._receive:
                if epoch != self._epoch:
                    continue
                with anyio.CancelScope() as scope:
                    self._current = scope
                    try:
                        async with aclosing(self._speak(text)) as audio:
                            async for chunk in audio:
                                await emit(SegmentAudio(number, chunk))
                    finally:
                        self._current = None
                if not scope.cancelled_caught:
                    await emit(SegmentDone(number))
