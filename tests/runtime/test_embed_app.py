"""The embedding guide's example app runs end to end and reports consistent numbers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import anyio
import pytest

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

APP = Path(__file__).parents[2] / "examples" / "embed_app.py"


def _load_app() -> ModuleType:
    spec = importlib.util.spec_from_file_location("embed_app", APP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_embed_app_runs_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(80):
        report = await _load_app().main()
    metrics = report["request"]["metrics"]
    assert metrics.finished and metrics.audio_seconds == pytest.approx(report["request"]["audio"])
    assert metrics.ttfa <= metrics.total and metrics.rtf == pytest.approx(
        metrics.total / metrics.audio_seconds
    )
    assert len(report["many"]) == 4 and all(seconds > 0 for seconds in report["many"])
    segments = report["session"]
    assert segments == sorted(segments) and set(segments) == {0, 1, 2}
    assert report["cancelled"] == (True, True)
    printed = capsys.readouterr().out
    assert "'Good morning.', 'The weather is fine today.', 'And tomorrow'" in printed
    assert "listener cancelled" in printed
