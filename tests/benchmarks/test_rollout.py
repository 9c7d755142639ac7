"""The rollout benchmark, run once at the tiny size: no timing is asserted (the machine may be
busy), only that every horizon is measured on both systems, that they agreed, the frame counts,
the JSON shape, the text report, the plot and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import quiet
from benchmarks.rollout import RolloutConfig, format_rollout, plot_rollout, preset, run_rollout
from mstar_async.cli import main

pytestmark = pytest.mark.timeout(90)
TINY = RolloutConfig(mode="quick", size="tiny", horizons=(2, 5), repeat=2)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out = run_rollout(TINY, quiet)
    assert json.loads(json.dumps(out)) == out
    return out


def test_every_horizon_has_both_systems_and_they_agree(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "rollout"
    assert [e["horizon"] for e in report["results"]] == [2, 5]
    for entry in report["results"]:
        assert entry["cached_s"]["n"] == entry["recompute_s"]["n"] == 2
        assert entry["cached_s"]["median"] > 0 and entry["recompute_s"]["median"] > 0
        assert entry["speedup"]["median"] > 0
        assert entry["max_abs_diff"] <= 1e-3
    assert set(report["speedup"]) == {"2", "5"}
    assert report["aim"]["measured"] is None  # horizon 30 was not asked for


def test_frame_counts_and_workload(report: dict[str, Any]) -> None:
    # tiny: 2 context frames; the reference computes 2 + 3 + ... frames, the cache one a step
    frames = {e["horizon"]: e["frames"] for e in report["results"]}
    assert frames[2] == {"cached": 3, "recompute": 5}
    assert frames[5] == {"cached": 6, "recompute": 2 + 3 + 4 + 5 + 6}
    workload = report["workload"]
    assert workload["predictor_tokens_per_frame"] == 18
    assert workload["latent_tokens_per_frame"] == 16
    assert workload["torch_threads"] == 1


def test_text_report_and_plot(report: dict[str, Any], tmp_path: Path) -> None:
    text = format_rollout(report)
    assert "horizon" in text and len(text.splitlines()) == 4
    pytest.importorskip("matplotlib")
    path = tmp_path / "rollout.png"
    assert plot_rollout(report, path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets() -> None:
    assert preset("quick").horizons == (4, 8, 16) and preset("quick").repeat == 1
    assert preset("default").horizons == (4, 8, 16, 30) and preset("default").size == "small"
    with pytest.raises(ValueError, match="unknown rollout preset"):
        preset("huge")


def test_the_command_prints_the_speedup_per_horizon(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "rollout", "--quick", "--json", "--size", "tiny", "--horizons", "3"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["speedup"]) == {"3"} and printed["workload"]["mode"] == "quick"
