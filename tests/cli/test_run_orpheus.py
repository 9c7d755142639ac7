"""``mstar run orpheus -o FILE``: a WAV file, TTFA and RTF printed."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import pytest

from mstar_async.cli import main


@pytest.mark.timeout(90)
def test_mstar_run_orpheus_writes_a_24khz_wav(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hello.wav"
    argv = ["run", "orpheus", "--text", "Hello there, how are you?", "--max-tokens", "42"]
    assert main([*argv, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFA " in printed and "RTF " in printed and f"wrote {out}" in printed
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        assert w.getnframes() == 6 * 2048  # 42 tokens = 6 frames of 7 codes


def test_mstar_run_json_reports_the_real_time_factor(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "orpheus", "--json", "--text", "Hi", "--max-tokens", "28"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["audio_seconds"] == pytest.approx(4 * 2048 / 24_000)
    assert summary["real_time_factor"] == pytest.approx(
        summary["seconds_total"] / summary["audio_seconds"]
    )
    assert 0 < summary["seconds_to_first_audio"] <= summary["seconds_total"]


def test_mstar_run_rejects_an_unknown_output_extension(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "orpheus", "-o", "out.aac"]) == 2
    assert "cannot save outputs as 'out.aac': use one of .wav" in capsys.readouterr().err
