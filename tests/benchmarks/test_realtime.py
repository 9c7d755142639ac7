"""``mstar bench realtime``: where the speech is in the shipped sentence, the options, and the
quick run end to end (two rounds of live sessions; figures consistent, no speed asserted)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mstar_async.bench.realtime import (
    CLIENT_RATE,
    PIECE_S,
    VAD,
    RealtimeConfig,
    configure,
    format_report,
    load_speech,
    preset,
    speech_bounds,
)
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(300)


def test_speech_bounds_find_the_loud_part_to_10_ms() -> None:
    rate = 16_000
    audio = np.zeros(rate, np.float32)
    audio[3200:9600] = 0.5 * np.sin(np.arange(6400) / 7)  # 200 ms to 600 ms
    audio[:160] = 1e-4  # far under the floor: not speech
    assert speech_bounds(audio, rate) == (0.2, 0.6)
    with pytest.raises(ValueError, match="silent"):
        speech_bounds(np.zeros(rate, np.float32), rate)


def test_the_sent_audio_is_the_sentence_between_the_silences() -> None:
    config = RealtimeConfig(lead_s=0.5, tail_s=1.0)
    speech = load_speech(config)
    samples = len(speech.pcm) // 2
    # espeak-ng's sentence fills its file: the speech starts right after the lead silence.
    assert speech.onset_s == pytest.approx(0.5, abs=0.011)
    assert speech.end_s == pytest.approx(samples / CLIENT_RATE - 1.0, abs=0.011)
    assert all(len(p) == 2 * int(CLIENT_RATE * PIECE_S) for p in speech.pieces[:-1])
    assert b"".join(speech.pieces) == speech.pcm


def test_presets_and_bad_options() -> None:
    assert preset(True).sessions == (1, 2) and preset(False).sessions == (1, 4, 8)
    assert configure(preset(True), sessions=(3,), size=None).sessions == (3,)
    with pytest.raises(ValueError, match="size"):
        RealtimeConfig(size="huge")
    with pytest.raises(ValueError, match=">= 1"):
        RealtimeConfig(sessions=(0,))
    assert preset(False).rounds == 1 and configure(preset(False), rounds=5).rounds == 5
    with pytest.raises(ValueError, match=">= 1"):
        RealtimeConfig(rounds=0)


@pytest.fixture(scope="module")
def report(realtime_run: BenchRun) -> dict[str, Any]:
    assert "N=2: barge-in" in realtime_run.progress  # progress goes to stderr
    return realtime_run.report


def test_quick_report_figures_are_consistent(report: dict[str, Any]) -> None:
    assert [r["sessions"] for r in report["results"]] == [1, 2]
    assert report["workload"]["reply_tokens"] == 4
    assert report["workload"]["speech_onset_s"] == pytest.approx(0.5, abs=0.011)
    frame_ms = 32  # the VAD decides once per 32 ms frame at 16 kHz
    for r in report["results"]:
        assert r["rounds"] == 1 and r["barge_ins"] == r["sessions"]
        # Every session's long reply was cut by its user's speech, and nothing else.
        assert r["barge_in_statuses"] == ["cancelled: turn_detected"]
        barge = r["barge_in_to_response_done_ms"]
        assert 0 < barge["p50"] <= barge["p95"] <= barge["max"]
        assert r["barge_in_last_speech_started_to_kv_free_ms"] >= 0
        # Speech start is found within a few frames of the true onset (espeak's first
        # syllable is loud); the stop, past the silence VAD waits for, as close.
        start, stop = r["vad_start_lag_audio_ms"], r["vad_stop_lag_audio_ms"]
        assert -2 * frame_ms <= start["p50"] <= 4 * frame_ms
        assert -VAD["silence_duration_ms"] < stop["p50"] <= 4 * frame_ms
        assert r["vad_start_lag_wall_ms"]["p50"] > 0  # caused by audio already sent
        assert r["ttfa_realtime_ms"]["p50"] > 0 and r["ttfa_chat_ms"]["p50"] > 0
        ratio = r["ttfa_realtime_ms"]["p50"] / r["ttfa_chat_ms"]["p50"]
        assert r["ttfa_realtime_over_chat_p50"] == pytest.approx(ratio, rel=0.01)
        assert r["reply_audio_s_p50"] > 0 and r["underruns"] >= 0
        # The spoken turn was answered: its first audio came after speech_stopped, which came
        # before the commit that waited for the encoder's last work.
        spoken, commit = r["spoken_ttfa_ms"], r["spoken_stop_to_committed_ms"]
        assert 0 < spoken["p50"] <= spoken["p95"] <= spoken["max"]
        assert 0 < commit["p50"] <= spoken["p50"]
        ratio = r["spoken_ttfa_ms"]["p50"] / r["ttfa_realtime_ms"]["p50"]
        assert r["spoken_over_text_ttfa_p50"] == pytest.approx(ratio, rel=0.01)
        # Every spoken turn was heard; what was left to encode is under one second of audio.
        assert 0 <= r["spoken_unheard_at_stop_ms_mean"] < 1000
    one = report["results"][0]
    aim = next(a for a in report["aims"] if a["name"].startswith("spoken TTFA"))
    assert aim["target"] == 1.2 and aim["measured"] == one["spoken_over_text_ttfa_p50"]
    assert aim["met"] is (one["spoken_over_text_ttfa_p50"] <= 1.2)
    text = format_report(report)
    assert "TTFA rt p50" in text and "spoken p50" in text
    assert "aim barge-in" in text and "aim spoken TTFA" in text
