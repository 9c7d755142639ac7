"""Speech chunks as 16-bit PCM at a chosen sample rate, resampled as a stream when the rates
differ: what a voice pipeline's transport plays."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mstar_async.audio import to_s16le
from mstar_async.outputs import AudioChunk


class PcmConverter:
    """Turns one utterance's ``AudioChunk``s into s16le mono bytes at ``sample_rate``.

    At the model's own rate the samples are only quantised (``mstar_async.audio.to_s16le``);
    otherwise a streaming soxr resampler (high quality) keeps its filter state across chunks,
    so chunk boundaries leave no clicks, and ``finish()`` returns the samples its filter still
    holds. Use one converter per utterance. Not safe to share between tasks.

    Raises:
        ValueError: ``sample_rate`` is not positive.
    """

    def __init__(self, sample_rate: int) -> None:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = sample_rate
        self._source_rate: int | None = None
        self._stream: Any = None

    def convert(self, chunk: AudioChunk) -> bytes:
        """The chunk's samples as s16le bytes at ``sample_rate`` (possibly empty: a resampler
        may hold back a few samples).

        Raises:
            ValueError: the chunk's sample rate differs from the utterance's first chunk.
        """
        if self._source_rate is None:
            self._source_rate = chunk.sample_rate
            if chunk.sample_rate != self.sample_rate:
                self._stream = _resample_stream(chunk.sample_rate, self.sample_rate)
        elif chunk.sample_rate != self._source_rate:
            raise ValueError(
                f"an utterance changed sample rate from {self._source_rate} to "
                f"{chunk.sample_rate} Hz; use one converter per utterance"
            )
        if self._stream is None:
            return to_s16le(chunk.pcm)
        samples = chunk.pcm.detach().reshape(-1).float().numpy()
        return _s16le(self._stream.resample_chunk(samples))

    def finish(self) -> bytes:
        """The resampler's remaining samples as s16le bytes (empty without resampling)."""
        if self._stream is None:
            return b""
        tail = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        self._stream = None
        return _s16le(tail)


def _resample_stream(source_rate: int, target_rate: int) -> Any:
    try:
        import soxr
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "resampling speech needs the soxr package: pip install 'mstar-async[voice]' "
            "(or declare the model's own sample rate to the pipeline)"
        ) from None
    return soxr.ResampleStream(source_rate, target_rate, 1, dtype="float32", quality="HQ")


def _s16le(samples: np.ndarray) -> bytes:
    return to_s16le(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)))
