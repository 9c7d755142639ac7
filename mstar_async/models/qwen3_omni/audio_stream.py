"""Encoding utterances while they are spoken: mel frames in as they come, thinker rows out one
attention window at a time.

The encoder's work splits exactly (see :mod:`~mstar_async.models.qwen3_omni.audio_encoder`):
each chunk of ``2 * n_window`` mel frames is convolved alone, and attention stays within windows
of ``window_chunks`` chunks. So a chunk is convolved as soon as its frames are in, and a window
is attended and projected as soon as its last chunk is; at the end of the utterance the last,
shorter chunk (span ``min(2 * n_window, frames)``, as the whole encoding gives it) and the last
window follow. The rows of a finished utterance, joined, are :meth:`AudioEncoder.forward`'s for
its frames; only the batch around each call differs, which moves float32 results by rounding.

With the released sizes a chunk is 1 s of speech and a window 8 s: while the user talks, every
second's convolutions run as it arrives and every 8 s a window's transformer; when they stop,
what is left is one partial chunk and at most one window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoder, AudioEncoderConfig

__all__ = ["AudioEncoderStream", "encode_streams"]


class AudioEncoderStream:
    """One utterance's encoder state: mel frames not yet in a chunk, and the embedded chunks of
    the window not yet attended. :func:`encode_streams` does the work of many streams at once.

    Synchronous and not thread-safe; no cancellation point. A method that raises leaves the
    stream as it was.
    """

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        self.config = cfg
        self._pending = torch.zeros(cfg.num_mel_bins, 0)
        self._window: list[torch.Tensor] = []
        self._frames = 0
        self._tokens = 0
        self._finished = False

    @property
    def frames(self) -> int:
        """Mel frames pushed so far."""
        return self._frames

    @property
    def convolved(self) -> int:
        """Mel frames already through the convolutions (in chunks embedded so far)."""
        return self._frames - int(self._pending.shape[1])

    @property
    def tokens(self) -> int:
        """Rows :func:`encode_streams` has returned for this utterance so far."""
        return self._tokens

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called."""
        return self._finished

    @property
    def done(self) -> bool:
        """Finished, and every row returned (``tokens == output_length(frames)``)."""
        return self._finished and self._tokens == self.config.output_length(self._frames)

    def push(self, mel: torch.Tensor) -> None:
        """Add mel frames ``[num_mel_bins, n]`` (n may be 0).

        Raises:
            ValueError: the wrong shape.
            RuntimeError: the stream is finished.
        """
        if self._finished:
            raise RuntimeError("push after finish")
        if mel.dim() != 2 or mel.shape[0] != self.config.num_mel_bins:
            raise ValueError(
                f"mel frames must be [{self.config.num_mel_bins}, n], got {tuple(mel.shape)}"
            )
        self._pending = torch.cat([self._pending.to(mel), mel], dim=1)
        self._frames += mel.shape[1]

    def finish(self) -> None:
        """End the utterance: its last chunk and window become ready.

        Raises:
            ValueError: no frame was pushed (an utterance has at least one).
            RuntimeError: already finished.
        """
        if self._finished:
            raise RuntimeError("finish called twice")
        if self._frames == 0:
            raise ValueError("an utterance needs at least one mel frame")
        self._finished = True

    def _ready_chunks(self) -> tuple[list[torch.Tensor], int]:
        """Chunks to convolve now, and their span."""
        size = self.config.chunk_frames
        whole = self._pending.shape[1] // size * size
        # torch.split of no columns still gives one (empty) piece.
        chunks = list(torch.split(self._pending[:, :whole], size, dim=1)) if whole else []
        if self._finished and whole < self._pending.shape[1]:
            chunks.append(self._pending[:, whole:])
        return chunks, min(size, self._frames)

    def _commit(self, frames: int, window: list[torch.Tensor], tokens: int) -> None:
        """Record a step: ``frames`` pending frames convolved, ``window`` the open window's
        chunks now, ``tokens`` rows returned."""
        self._pending = self._pending[:, frames:]
        self._window = window
        self._tokens += tokens


@dataclass
class _Plan:
    chunks: list[torch.Tensor]
    window: list[torch.Tensor]
    windows: int


def encode_streams(
    encoder: AudioEncoder, streams: Sequence[AudioEncoderStream]
) -> list[torch.Tensor]:
    """Do every stream's ready work in one convolution batch and one attention batch: return
    each stream's new rows, ``[n, output_dim]`` (n is 0 until a window completes, or the
    stream finishes).

    Synchronous (torch-bound), no cancellation point; the streams change only once all the
    work has succeeded.

    Raises:
        ValueError: a stream of another config than the encoder's, or the same stream twice.
    """
    cfg = encoder.config
    if any(stream.config != cfg for stream in streams):
        raise ValueError("a stream's config differs from the encoder's")
    if len({id(stream) for stream in streams}) != len(streams):
        raise ValueError("a stream is listed twice")
    ready = [stream._ready_chunks() for stream in streams]
    chunks = [chunk for mine, _ in ready for chunk in mine]
    spans = [span for mine, span in ready for _ in mine]
    embedded = iter(encoder.embed_chunks(chunks, spans))
    plans: list[_Plan] = []
    windows: list[torch.Tensor] = []
    for stream, (mine, _) in zip(streams, ready, strict=True):
        window = stream._window + [next(embedded) for _ in mine]
        size = cfg.window_chunks
        complete = len(window) // size * size
        cuts = [window[s : s + size] for s in range(0, complete, size)]
        if stream.finished and complete < len(window):
            cuts.append(window[complete:])
        windows += [torch.cat(cut) for cut in cuts]
        plans.append(_Plan(mine, window[len(cuts) * size :], len(cuts)))
    attended = iter(encoder.attend(windows))
    none = encoder.proj2.weight.new_zeros(0, cfg.output_dim)
    out = []
    for stream, plan in zip(streams, plans, strict=True):
        rows = [next(attended) for _ in range(plan.windows)]
        new = torch.cat(rows) if rows else none
        stream._commit(sum(chunk.shape[1] for chunk in plan.chunks), plan.window, new.shape[0])
        out.append(new)
    return out
