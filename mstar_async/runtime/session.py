"""Speech from text that arrives piece by piece: cut into segments, each voiced by one request.

An app that speaks an LLM's reply as it is written pushes the text as it comes. The session cuts
it at sentence ends (or where the app calls ``flush()``), starts one request of the model per
segment as soon as that segment is complete, and hands the outputs back in segment order, each
tagged with its segment number. Up to ``lookahead`` segments after the one being read are
synthesised ahead, so segment k+1 is ready while k plays, without a long text holding KV for
every sentence at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import uuid
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio

from mstar_async.conductor import Conductor, RequestMetrics, RequestStream
from mstar_async.errors import MstarError, RequestError, SessionClosed

# A sentence ends at terminal punctuation (and any closing quotes or brackets) once whitespace
# follows it: "3." may still become "3.14". CJK full stops need no space; a newline ends a line.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|[。！？]+[」』”’)]*|\n")


def split_sentences(text: str) -> tuple[list[str], str]:
    """Cut ``text`` after each complete sentence: (the sentences, stripped and non-empty; the
    unfinished rest). Whitespace aside, the sentences followed by the rest are ``text``."""
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        piece = text[start : match.end()].strip()
        if piece:
            sentences.append(piece)
        start = match.end()
    return sentences, text[start:]


def _tagged(output: Any, segment: int) -> Any:
    if "segment" in getattr(type(output), "__dataclass_fields__", {}):
        return dataclasses.replace(output, segment=segment)
    return output


class SpeechSession:
    """Streaming text in, the model's outputs (audio, text) out, segment by segment.

    Get one from ``Runtime.speech_session``; use it as ``async with rt.speech_session() as s``,
    push text with ``push_text``, mark cuts with ``flush``, finish with ``end_input``, and
    iterate ``s`` (from the same or another task) for the outputs. ``AudioChunk`` and
    ``TextDelta`` outputs carry their segment number (0, 1, ...); outputs come in segment order.
    ``aclose()`` (or leaving the block, or cancelling the reader) stops every segment's request
    and waits until their engines have released them.
    """

    def __init__(
        self,
        conductor: Conductor,
        inputs: dict[str, Any],
        *,
        text_input: str = "text",
        lookahead: int = 1,
        session_id: str | None = None,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        try:
            inspect.signature(conductor.model.program).bind(None, **{**inputs, text_input: ""})
        except TypeError as exc:
            raise RequestError(
                f"model {conductor.model.name!r} cannot voice a speech session: its program "
                f"does not take {text_input!r} with inputs {sorted(inputs)}: {exc}"
            ) from None
        self.session_id = session_id or uuid.uuid4().hex[:12]
        self.segments: list[str] = []
        self._conductor = conductor
        self._inputs = inputs
        self._text_input = text_input
        self._lookahead = lookahead
        self._buffer = ""
        self._streams: list[RequestStream] = []
        self._current = 0
        self._ended = False
        self._closed = False
        self._changed = anyio.Event()

    @property
    def metrics(self) -> list[RequestMetrics]:
        """The metrics of each segment's request started so far, in segment order."""
        return [stream.metrics for stream in self._streams]

    def push_text(self, text: str) -> None:
        """Add text; every sentence it completes becomes a segment and may start at once.

        Raises:
            SessionClosed: after ``end_input()`` or ``aclose()``.
        """
        self._check_open("push_text")
        sentences, self._buffer = split_sentences(self._buffer + text)
        for sentence in sentences:
            self._add_segment(sentence)

    def flush(self) -> None:
        """Make the text pushed so far a segment now, sentence ended or not (if not blank).

        Raises:
            SessionClosed: after ``end_input()`` or ``aclose()``.
        """
        self._check_open("flush")
        self._add_segment(self._buffer.strip())
        self._buffer = ""

    def end_input(self) -> None:
        """No more text: what is left becomes the last segment, and iteration ends after it.
        Calling it again does nothing.

        Raises:
            SessionClosed: after ``aclose()``.
        """
        if self._closed:
            raise SessionClosed(f"speech session {self.session_id} is closed")
        if self._ended:
            return
        self.flush()
        self._ended = True
        self._changed.set()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise SessionClosed(f"speech session {self.session_id}: {what}() after aclose()")
        if self._ended:
            raise SessionClosed(
                f"speech session {self.session_id}: {what}() after end_input(); open a new "
                "session for more text"
            )

    def _add_segment(self, text: str) -> None:
        if text:
            self.segments.append(text)
            self._start_ready()
            self._changed.set()

    def _start_ready(self) -> None:
        limit = min(len(self.segments), self._current + 1 + self._lookahead)
        for k in range(len(self._streams), limit):
            self._streams.append(
                self._conductor.generate(
                    request_id=f"{self.session_id}.{k}",
                    **{**self._inputs, self._text_input: self.segments[k]},
                )
            )

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        """The next output, in segment order; waits for text when every segment is spoken.

        Raises:
            RequestError: a segment's request failed (the session is closed first).
            RequestCancelled: a segment's request was cancelled from elsewhere.
        """
        while not self._closed:
            if self._current < len(self.segments):
                self._start_ready()
                stream = self._streams[self._current]
                try:
                    output = await stream.__anext__()
                except StopAsyncIteration:
                    self._current += 1
                    continue
                except MstarError:
                    if self._closed:
                        break  # closed from another task: the end, not a failure
                    await self.aclose()
                    raise
                return _tagged(output, self._current)
            if self._ended:
                break
            self._changed = anyio.Event()
            await self._changed.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop every segment still running and wait until each has released its engines.

        Safe to call more than once and from a cancelled task (each wait is shielded).
        """
        self._closed = True
        self._changed.set()
        for stream in self._streams:
            stream.cancel()
        for stream in self._streams:
            await stream.aclose()

    async def __aenter__(self) -> SpeechSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
