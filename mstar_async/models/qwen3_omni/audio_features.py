"""Log-mel features of 16 kHz speech as upstream's Whisper feature extractor makes them, for a
whole utterance or streamed while it is spoken.

:func:`log_mel` is ``WhisperFeatureExtractor(feature_size=128)`` on one unpadded utterance (the
Qwen3-Omni processor's ``padding=True`` with one audio): a centred STFT (periodic Hann of 400,
hop 160, the signal reflected 200 samples past both ends), the last STFT frame dropped, power
through 128 slaney-normalised mel filters (0-8 kHz), ``log10`` of at least 1e-10, floored at
the utterance's maximum minus 8, scaled ``(x + 4) / 4``: ``samples // 160`` frames.

:class:`LogMelStream` takes PCM in pieces of any size and returns frame ``t`` as soon as
samples ``0 .. 160 t + 199`` are in (frame 0 also waits for sample 200, which the start
reflection reads); at :meth:`~LogMelStream.finish` the end reflection is known and the last
frames follow. Before the floor, every streamed frame, the edge ones included, is the whole
computation's (the same arithmetic on the same samples, whatever the pieces). The floor cannot
wait for the utterance's maximum, so a streamed frame is floored at the *running* maximum, over
every bin of it and of the frames before it, minus 8. Frames from the one holding the
utterance's maximum on are therefore identical to :func:`log_mel`'s; an earlier frame differs
only in bins below ``max - 8``, where the stream's floor is lower (a leading silence keeps more
of its depth). Floored again at the utterance's maximum minus 8, streamed frames are
:func:`log_mel`'s.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["HOP", "N_FFT", "N_MELS", "SAMPLE_RATE", "LogMelStream", "log_mel", "mel_filters"]

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 128
#: Samples the start (and end) reflection reads: the edge sample and 200 beyond it.
_EDGE = N_FFT // 2 + 1
_DYNAMIC_RANGE = 8.0


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    # Slaney's scale: linear below 1 kHz, logarithmic above.
    log_step = 27.0 / math.log(6.4)
    mel = 3.0 * hz / 200.0
    return torch.where(hz >= 1000.0, 15.0 + torch.log(hz / 1000.0) * log_step, mel)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    log_step = math.log(6.4) / 27.0
    hz = 200.0 * mel / 3.0
    return torch.where(mel >= 15.0, 1000.0 * torch.exp(log_step * (mel - 15.0)), hz)


@functools.cache
def mel_filters() -> torch.Tensor:
    """The slaney mel filter bank from 0 Hz to 8 kHz, ``[201, 128]`` float32 (built in float64,
    as upstream's).

    Triangles on the slaney mel scale, each scaled by ``2 / bandwidth`` so every filter passes
    about the same energy. Cached; the returned tensor is shared, do not modify it. Raises
    nothing.
    """
    top = float(_hz_to_mel(torch.tensor(SAMPLE_RATE / 2, dtype=torch.float64)))
    bins = torch.linspace(0.0, SAMPLE_RATE // 2, N_FFT // 2 + 1, dtype=torch.float64)
    edges = torch.linspace(0.0, top, N_MELS + 2, dtype=torch.float64)
    centres = _mel_to_hz(edges)
    widths = centres.diff()
    offsets = centres[None, :] - bins[:, None]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return (triangles * (2.0 / (centres[2:] - centres[:-2]))).float()


def _log_power(padded: torch.Tensor, frames: int) -> torch.Tensor:
    """``log10`` mel power of the first ``frames`` STFT frames of an already padded signal,
    ``[n_mels, frames]``, before the floor."""
    windows = padded.unfold(0, N_FFT, HOP)[:frames]
    spectrum = torch.fft.rfft(windows * torch.hann_window(N_FFT, device=padded.device), dim=1)
    power = spectrum.abs() ** 2
    mel = mel_filters().to(padded.device).T @ power.T
    return torch.clamp(mel, min=1e-10).log10()


def _scale(logs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return (torch.maximum(logs, floor) + 4.0) / 4.0


def _check_pcm(pcm: torch.Tensor) -> torch.Tensor:
    if pcm.dim() != 1:
        raise ValueError(f"PCM must be one channel [samples], got {tuple(pcm.shape)}")
    return pcm.float()


def log_mel(pcm: torch.Tensor) -> torch.Tensor:
    """Whisper log-mel features of a whole 16 kHz utterance, ``[128, samples // 160]`` float32.

    Synchronous, torch-bound; no cancellation point.

    Raises:
        ValueError: ``pcm`` is not 1-D, or has fewer than 201 samples (the reflection at each
            end reads 201; upstream's STFT fails there too).
    """
    pcm = _check_pcm(pcm)
    if pcm.numel() < _EDGE:
        raise ValueError(f"need at least {_EDGE} samples, got {pcm.numel()}")
    padded = torch.cat([pcm[1:_EDGE].flip(0), pcm, pcm[-_EDGE:-1].flip(0)])
    logs = _log_power(padded, pcm.numel() // HOP)
    return _scale(logs, logs.max() - _DYNAMIC_RANGE)


class LogMelStream:
    """One utterance's log-mel frames as its PCM arrives (see the module docstring for how they
    relate to :func:`log_mel`'s).

    Holds at most one frame's worth of samples (plus the piece being added) and the running
    maximum. Not thread-safe; synchronous, so it has no cancellation point, and a call that
    raises leaves the stream as it was.
    """

    def __init__(self) -> None:
        # The reflected, padded signal from the next frame's first sample on; before the first
        # 201 samples are in, the raw samples (the start reflection needs all of them).
        self._buffer = torch.zeros(0)
        self._started = False
        self._samples = 0
        self._frames = 0
        self._max = -math.inf
        self._finished = False

    @property
    def frames(self) -> int:
        """Frames returned so far."""
        return self._frames

    @property
    def samples(self) -> int:
        """Samples pushed so far."""
        return self._samples

    def push(self, pcm: torch.Tensor) -> torch.Tensor:
        """Add 16 kHz samples; return the frames they complete, ``[128, n]`` (n may be 0).

        Raises:
            ValueError: ``pcm`` is not 1-D.
            RuntimeError: the stream is finished.
        """
        if self._finished:
            raise RuntimeError("push after finish")
        pcm = _check_pcm(pcm)
        buffer = torch.cat([self._buffer.to(pcm.device), pcm])
        started = self._started or buffer.numel() >= _EDGE
        if started and not self._started:
            buffer = torch.cat([buffer[1:_EDGE].flip(0), buffer])
        self._buffer, self._started = buffer, started
        self._samples += pcm.numel()
        if not started or buffer.numel() < N_FFT:
            return torch.zeros(N_MELS, 0, device=pcm.device)
        return self._emit((buffer.numel() - N_FFT) // HOP + 1)

    def finish(self) -> torch.Tensor:
        """End the utterance: return its remaining frames, ``[128, n]``; afterwards
        :attr:`frames` is ``samples // 160``.

        Raises:
            ValueError: fewer than 201 samples in all (as :func:`log_mel`).
            RuntimeError: already finished.
        """
        if self._finished:
            raise RuntimeError("finish called twice")
        if not self._started:
            raise ValueError(f"need at least {_EDGE} samples, got {self._samples}")
        # A frame not yet returned starts at least 240 samples before the end (or is the first
        # frame), so the buffer ends with the 201 samples the end reflection reads.
        assert self._buffer.numel() >= _EDGE
        self._buffer = torch.cat([self._buffer, self._buffer[-_EDGE:-1].flip(0)])
        self._finished = True
        return self._emit(self._samples // HOP - self._frames)

    def _emit(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.zeros(N_MELS, 0, device=self._buffer.device)
        logs = _log_power(self._buffer, count)
        running = torch.cummax(logs.max(dim=0).values, dim=0).values.clamp(min=self._max)
        self._max = float(running[-1])
        self._buffer = self._buffer[count * HOP :]
        self._frames += count
        return _scale(logs, running[None, :] - _DYNAMIC_RANGE)
