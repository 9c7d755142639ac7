"""What the encoder hears of the input audio buffer: ``UnheardSamples`` releases exactly the
samples the VAD has judged, in timeline order, across commits and clears."""

from __future__ import annotations

import numpy as np
import pytest

from mstar_async.realtime.conversation import parse_item
from mstar_async.realtime.events import RealtimeError
from mstar_async.realtime.hearing import HeardTurn, UnheardSamples

pytestmark = pytest.mark.timeout(10)


def _ramp(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.float32)


def test_samples_are_released_up_to_the_vads_position_in_order() -> None:
    unheard = UnheardSamples()
    unheard.push(_ramp(0, 300))
    unheard.push(_ramp(300, 700))  # 1000 held, pieces of any size
    assert unheard.until(512).tolist() == list(range(512))
    assert unheard.until(512).size == 0  # nothing new judged
    assert unheard.until(1024).tolist() == list(range(512, 1000))  # only what is held
    assert (unheard.start, unheard.held) == (1000, 0)
    unheard.push(_ramp(1000, 100))
    assert unheard.until(1536).tolist() == list(range(1000, 1100))


def test_a_clear_drops_what_is_held_and_the_vads_old_frames_release_nothing() -> None:
    unheard = UnheardSamples()
    unheard.push(_ramp(0, 2000))
    assert unheard.until(512).size == 512
    unheard.drop(2000)  # the buffer was cleared at timeline sample 2000
    assert unheard.until(1536).size == 0  # the VAD catching up on cleared audio
    unheard.push(_ramp(2000, 600))
    assert unheard.until(2048).tolist() == list(range(2000, 2048))


def test_a_heard_turn_says_what_was_left_to_encode() -> None:
    turn = HeardTurn(samples=49_600, frames=310, frames_at_end=300, rows=40)
    assert turn.unheard_s == pytest.approx(0.10)


def test_item_audio_is_only_for_user_items() -> None:
    part = {"type": "input_audio", "audio": "AAAA" * 4000}
    item = parse_item({"type": "message", "role": "user", "content": [part]})
    assert item.audio is not None and item.audio.size == 4000  # 6000 samples at 24 kHz
    with pytest.raises(RealtimeError, match="only a user item"):
        parse_item({"type": "message", "role": "assistant", "content": [part]})
