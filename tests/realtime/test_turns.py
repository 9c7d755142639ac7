"""Server VAD turn detection: events alternate, times follow the Realtime API's rules, and a
sentence between silences is one turn."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.realtime.turns import (
    SpeechStarted,
    SpeechStopped,
    TurnDetection,
    TurnDetector,
    TurnEvent,
)

FRAME_MS = 32.0


def _events(probabilities: list[float], settings: TurnDetection) -> list[TurnEvent]:
    detector = TurnDetector(settings, FRAME_MS)
    return [e for p in probabilities if (e := detector.frame(p)) is not None]


def test_one_turn_with_prefix_padding_and_the_silence_included() -> None:
    settings = TurnDetection(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=480)
    probabilities = [0.0] * 50 + [0.9] * 40 + [0.0] * 30
    events = _events(probabilities, settings)
    assert events == [
        SpeechStarted(round(50 * FRAME_MS) - 300),
        SpeechStopped(round((90 + 15) * FRAME_MS)),  # 15 silent frames make 480 ms
    ]


def test_a_pause_shorter_than_the_silence_duration_does_not_end_the_turn() -> None:
    settings = TurnDetection(silence_duration_ms=500)
    probabilities = [0.9] * 10 + [0.0] * 10 + [0.9] * 10 + [0.0] * 20  # a 320 ms pause
    events = _events(probabilities, settings)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    assert events[0] == SpeechStarted(0)  # the padding stops at the buffer's start


def test_wavering_between_the_release_level_and_the_threshold_keeps_speaking() -> None:
    settings = TurnDetection(threshold=0.5, silence_duration_ms=100)
    events = _events([0.9] + [0.4, 0.45] * 20, settings)  # above 0.35, the release level
    assert events == [SpeechStarted(0)]


@given(
    st.lists(st.floats(0, 1), max_size=300),
    st.floats(0.05, 1.0),
    st.integers(0, 1000),
    st.integers(0, 2000),
)
def test_events_alternate_and_their_times_are_ordered(
    probabilities: list[float], threshold: float, padding: int, silence: int
) -> None:
    settings = TurnDetection(threshold, padding, silence)
    detector = TurnDetector(settings, FRAME_MS)
    last_end = 0
    started: SpeechStarted | None = None
    for i, p in enumerate(probabilities):
        event = detector.frame(p)
        if isinstance(event, SpeechStarted):
            assert started is None and p >= threshold
            assert event.audio_start_ms == max(0, round(i * FRAME_MS) - padding)
            started = event
        elif isinstance(event, SpeechStopped):
            assert started is not None and p < settings.release
            assert event.audio_end_ms >= started.audio_start_ms + silence
            assert event.audio_end_ms >= last_end
            last_end, started = event.audio_end_ms, None
        assert detector.speaking == (started is not None)
    assert detector.elapsed_ms == round(len(probabilities) * FRAME_MS)


@pytest.mark.parametrize(
    ("field", "value"),
    [("threshold", 1.5), ("prefix_padding_ms", -1), ("silence_duration_ms", 10**6)],
)
def test_bad_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        TurnDetection(**{field: value})
