"""Client pcm16 at 24 kHz to float 16 kHz as a stream: the same samples however the client cut
its audio, odd bytes kept for the next piece."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.realtime.resample import PcmResampler
from tests.realtime.audio import pcm16, sentence


def _resampled(data: bytes, cuts: list[int]) -> np.ndarray:
    resampler = PcmResampler(24_000, 16_000)
    pieces, start = [], 0
    for cut in [*sorted(cuts), len(data)]:
        pieces.append(resampler.push(data[start:cut]))
        start = cut
    pieces.append(resampler.flush())
    return np.concatenate(pieces)


AUDIO = pcm16(sentence("weather")[:24_000])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, len(AUDIO)), max_size=40))
def test_cutting_the_client_audio_anywhere_changes_nothing(cuts: list[int]) -> None:
    whole = _resampled(AUDIO, [])
    np.testing.assert_allclose(_resampled(AUDIO, cuts), whole, atol=1e-6)


def test_the_rate_and_level_are_kept() -> None:
    out = _resampled(AUDIO, [1001, 5000])
    assert abs(len(out) - len(AUDIO) // 2 * 2 // 3) <= 1
    source = np.frombuffer(AUDIO, "<i2").astype(np.float32) / 32768
    assert abs(float(np.sqrt(np.mean(out**2))) - float(np.sqrt(np.mean(source**2)))) < 0.01


def test_the_same_rate_passes_samples_through() -> None:
    resampler = PcmResampler(16_000, 16_000)
    out = resampler.push(pcm16(np.array([0.5, -0.25], np.float32)) + b"\x01")
    np.testing.assert_allclose(out, [0.5, -0.25], atol=1e-4)
    assert resampler.push(b"\x00").tolist() == [1 / 32768]
