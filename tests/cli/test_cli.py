"""The ``mstar`` command and the shipped example, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_async.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_mstar_help_lists_the_commands() -> None:
    result = subprocess.run(
        ["mstar", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "models" in result.stdout and "run" in result.stdout


def test_mstar_models_lists_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert "demo" in capsys.readouterr().out


def test_mstar_run_demo_prints_a_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--json", "--max-codes", "16", "--steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["audio_chunks"] == 3  # a window of 8 codes, then two strides of 4
    assert summary["audio_seconds"] == pytest.approx(16 * 320 / 16_000)
    assert summary["images"] == [[3, 16, 16]]
    assert 0 < summary["seconds_to_first_output"] <= summary["seconds_total"]


def test_mstar_run_rejects_an_unknown_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "demo", "--bogus", "1"]) == 2
    assert "takes no input --bogus" in capsys.readouterr().err


def test_mstar_run_rejects_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "nope"]) == 2
    assert "no model 'nope'" in capsys.readouterr().err


def test_quickstart_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "first audio after" in result.stdout
    assert "image: (3, 16, 16)" in result.stdout


def test_mstar_run_bagel_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    out = tmp_path / "out.png"
    argv = ["run", "bagel", "--prompt", "a red circle", "--steps", "2", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "image: 3x64x64" in printed
    assert f"wrote {out}" in printed
    assert "request took" in printed
    with Image.open(out) as image:
        assert image.size == (64, 64) and image.mode == "RGB"
