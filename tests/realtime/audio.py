"""The spoken fixtures (espeak-ng sentences, 24 kHz mono; see ``speech/make.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SPEECH = Path(__file__).parent / "speech"
CLIENT_RATE = 24_000


def sentence(name: str, rate: int = CLIENT_RATE) -> np.ndarray:
    """The fixture ``name`` as float32 samples at ``rate``."""
    audio, file_rate = sf.read(SPEECH / f"{name}.flac", dtype="float32")
    if file_rate != rate:
        audio = soxr.resample(audio, file_rate, rate).astype(np.float32)
    return np.asarray(audio, dtype=np.float32)


def with_silence(audio: np.ndarray, before_s: float, after_s: float, rate: int) -> np.ndarray:
    """``audio`` between stretches of silence."""
    return np.concatenate(
        [
            np.zeros(int(before_s * rate), np.float32),
            audio,
            np.zeros(int(after_s * rate), np.float32),
        ]
    )


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples as little-endian 16-bit PCM, the Realtime API's ``pcm16``."""
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
