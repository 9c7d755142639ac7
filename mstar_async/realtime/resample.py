"""Client audio in: pcm16 at the client's rate, decoded and resampled as a stream.

The Realtime API's clients send little-endian 16-bit mono PCM at 24 kHz in arbitrary pieces; the
VAD and the audio encoder take float samples at 16 kHz. ``PcmResampler`` keeps soxr's filter
state between pieces, so the resampled stream is the same however the client cut its audio,
and keeps a piece's odd trailing byte for the next one.
"""

from __future__ import annotations

import numpy as np
import soxr


class PcmResampler:
    """pcm16 bytes at ``in_rate`` in, float32 samples at ``out_rate`` out, piece by piece.

    Raises:
        ValueError: a rate is not a positive number.
    """

    def __init__(self, in_rate: int = 24_000, out_rate: int = 16_000) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, "float32")
        )
        self._odd = b""
        self.samples_in = 0

    def push(self, pcm: bytes) -> np.ndarray:
        """Samples resampled from ``pcm`` (and what earlier pieces left); may be empty while
        the filter fills. Never raises."""
        data = self._odd + pcm
        whole = len(data) - len(data) % 2
        self._odd = data[whole:]
        samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        self.samples_in += samples.size
        if self._stream is None:
            return samples
        out: np.ndarray = self._stream.resample_chunk(samples, last=False)
        return out

    def flush(self) -> np.ndarray:
        """The samples the filter still holds (the stream has ended); the resampler can go on
        afterwards as a new stream. Never raises."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail: np.ndarray = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._stream = soxr.ResampleStream(self.in_rate, self.out_rate, 1, "float32")
        return tail
