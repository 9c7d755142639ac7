"""Hearing the user while they talk: the input audio buffer's samples streamed into the model's
audio encoder as they arrive, so that when the turn is committed its encoding is (almost) done.

A session runs at most one ``Hearing`` at a time: one ``encode_only`` request of the served
model, fed the buffer's 16 kHz samples from its first sample after a commit or clear. With server
VAD the samples are fed as the VAD has judged them (``UnheardSamples`` holds the rest), so that
when it reports the end of a turn the hearing holds exactly the turn's samples; without VAD they
are fed as appended. A commit finishes the hearing (its last partial second and window are
encoded then) and hands its rows to the user message; a clear cancels it. The rows of the
turn's complete windows are final as soon as they come (``rows``; ``on_rows`` is told), which
lets the session prefill the turn's response that far while the user still speaks (``warm.py``).

If the encoder request fails or cannot start (the model at its in-flight bound), the hearing
reports no rows and the response encodes the turn's audio itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import torch
from anyio.abc import TaskGroup

from mstar_async.errors import MstarError
from mstar_async.logs import get_logger

log = get_logger("mstar_async.realtime")

#: Starts an encoder request over an async iterable of 16 kHz float tensors (or one whole
#: tensor), named by the string; the context manager yields the request's outputs
#: (``EncodedAudio``), in order.
Hear = Callable[[AsyncIterator[torch.Tensor] | torch.Tensor, str], AbstractAsyncContextManager[Any]]
#: Pieces of audio the encoder may lag behind before the feeder waits (~10 s of 20 ms pieces).
BACKLOG = 512
#: Mel frames per second of 16 kHz audio (hop 160).
FRAMES_PER_SECOND = 100


@dataclass(frozen=True, slots=True)
class HeardTurn:
    """How a committed turn was heard: its ``samples`` (16 kHz) and mel ``frames``, the frames
    the encoder had convolved when the turn ended (before the hearing was finished), and the
    ``rows`` the encoding has (0 when it failed and the response encodes the audio)."""

    samples: int
    frames: int
    frames_at_end: int
    rows: int

    @property
    def unheard_s(self) -> float:
        """Seconds of the turn the encoder had not yet convolved when it ended."""
        return (self.frames - self.frames_at_end) / FRAMES_PER_SECOND


class Hearing:
    """One utterance being encoded as it is spoken (see the module docstring).

    ``feed`` may wait (the encoder's backlog is full: backpressure reaches the client's
    appends); ``finish`` waits for the encoder's last work. Both are cancel-safe: cancelling
    the caller leaves the hearing to ``cancel``. ``on_rows`` (never raising) is called each
    time the encoder finishes rows of the utterance.
    """

    def __init__(
        self,
        hear: Hear,
        tg: TaskGroup,
        request_id: str,
        on_rows: Callable[[], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self._on_rows = on_rows
        self.fed = 0  # samples given to the encoder
        self.frames = 0  # mel frames it has convolved, as last reported
        self.failed: BaseException | None = None
        self._rows: list[torch.Tensor] = []
        self._send, receive = anyio.create_memory_object_stream[torch.Tensor](BACKLOG)
        self._done = anyio.Event()
        self._scope = anyio.CancelScope()
        tg.start_soon(self._run, hear, receive)

    async def _run(self, hear: Hear, receive: Any) -> None:
        async def audio() -> AsyncIterator[torch.Tensor]:
            async with receive:
                async for piece in receive:
                    yield piece

        try:
            with self._scope:
                async with hear(audio(), self.request_id) as outputs:
                    async for heard in outputs:
                        if heard.rows.numel():
                            self._rows.append(heard.rows)
                            if self._on_rows is not None:
                                self._on_rows()
                        self.frames = max(self.frames, int(heard.frames))
        except MstarError as exc:  # the encoder failed: the response will encode the audio
            self.failed = exc
            log.warning("realtime.hearing_failed", request_id=self.request_id, error=repr(exc))
        finally:
            self._done.set()
            receive.close()

    @property
    def rows(self) -> torch.Tensor | None:
        """The rows the encoder has finished so far (those of the utterance's complete
        windows: final, whatever is said next), or None before the first."""
        if len(self._rows) > 1:
            self._rows = [torch.cat(self._rows)]
        return self._rows[0] if self._rows else None

    async def feed(self, samples: np.ndarray) -> None:
        """Give the encoder more of the utterance (a failed hearing drops them)."""
        if not samples.size or self.failed is not None or self._done.is_set():
            return
        try:
            await self._send.send(torch.from_numpy(np.ascontiguousarray(samples)))
            self.fed += samples.size
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.failed = self.failed or RuntimeError("the encoder stopped reading")

    async def finish(self) -> torch.Tensor | None:
        """End the utterance; the encoder's rows for it, or None if the hearing failed."""
        self._send.close()
        await self._done.wait()
        if self.failed is not None or not self._rows or self._scope.cancel_called:
            return None
        return torch.cat(self._rows)

    def cancel(self) -> None:
        """Stop encoding (the request is closed, its state freed); idempotent, never raises."""
        self._send.close()
        self._scope.cancel()


async def encode_whole(hear: Hear, audio: np.ndarray, request_id: str) -> torch.Tensor | None:
    """The encoder's rows for a whole utterance (a created item's audio), or None when the
    encoder request fails (the response then encodes the audio). Cancel-safe: cancelling closes
    the request."""
    try:
        async with hear(torch.from_numpy(np.ascontiguousarray(audio)), request_id) as outputs:
            rows = [heard.rows async for heard in outputs if heard.rows.numel()]
    except MstarError as exc:
        log.warning("realtime.hearing_failed", request_id=request_id, error=repr(exc))
        return None
    return torch.cat(rows) if rows else None


class UnheardSamples:
    """Samples appended to the buffer that the VAD has not judged yet, from timeline sample
    ``start`` on: released to the hearing as the VAD's frames cover them. Synchronous."""

    def __init__(self) -> None:
        self._pieces: deque[np.ndarray] = deque()
        self.start = 0  # the timeline position of the first held sample
        self.held = 0

    def push(self, samples: np.ndarray) -> None:
        """Hold ``samples`` (the next on the timeline)."""
        if samples.size:
            self._pieces.append(samples)
            self.held += samples.size

    def until(self, position: int) -> np.ndarray:
        """Release the held samples before timeline ``position`` (none if it is behind)."""
        want = min(max(0, position - self.start), self.held)
        out: list[np.ndarray] = []
        left = want
        while left:
            piece = self._pieces[0]
            if piece.size <= left:
                out.append(self._pieces.popleft())
                left -= piece.size
            else:
                out.append(piece[:left])
                self._pieces[0] = piece[left:]
                left = 0
        self.start += want
        self.held -= want
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def drop(self, position: int) -> None:
        """Forget everything held; the next sample pushed sits at timeline ``position``."""
        self._pieces.clear()
        self.held = 0
        self.start = position
