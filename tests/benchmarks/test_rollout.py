"""The rollout benchmark, run once at the tiny size: no timing is asserted (the machine may be
busy), only that every horizon is measured on both systems, that they agreed, the frame counts,
the JSON shape, the text report, the plot and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mstar_async.bench.common import quiet
from mstar_async.bench.report import check_report
from mstar_async.bench.rollout import (
    RolloutConfig,
    format_rollout,
    plot_rollout,
    preset,
    run_rollout,
)
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def report(rollout_run: BenchRun) -> dict[str, Any]:
    return rollout_run.report


def test_every_horizon_has_both_systems_and_they_agree(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "rollout"
    assert [s["name"] for s in report["systems"]] == ["cached", "recompute"]
    assert [e["horizon"] for e in report["results"]] == [2, 5]
    for entry in report["results"]:
        assert entry["cached_s"]["n"] == entry["recompute_s"]["n"] == 2
        assert entry["cached_s"]["median"] > 0 and entry["recompute_s"]["median"] > 0
        assert entry["speedup"]["median"] > 0
        assert entry["max_abs_diff"] <= 1e-3
    (aim,) = report["aims"]
    assert aim["horizon"] == 30 and aim["target"] == 12.5
    assert aim["measured"] is None and aim["met"] is None  # horizon 30 was not asked for


def test_a_run_of_the_config_gives_the_same_shape() -> None:
    out = run_rollout(RolloutConfig(mode="quick", size="tiny", horizons=(2,), repeat=1), quiet)
    check_report(out)
    assert json.loads(json.dumps(out)) == out


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
    assert "horizon" in text and len(text.splitlines()) == 5
    assert "not measured (horizon 30 not in this run)" in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "rollout.png"
    assert plot_rollout(report, path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets() -> None:
    assert preset("quick").horizons == (4, 8, 16) and preset("quick").repeat == 1
    assert preset("default").horizons == (4, 8, 16, 30) and preset("default").size == "small"
    with pytest.raises(ValueError, match="unknown rollout preset"):
        preset("huge")


def test_the_command_prints_the_speedup_per_horizon(rollout_run: BenchRun) -> None:
    printed = rollout_run.report  # mstar bench rollout --quick --json, parsed
    speedups = {row["horizon"]: row["speedup"]["median"] for row in printed["results"]}
    assert set(speedups) == {2, 5} and printed["workload"]["mode"] == "quick"
    assert "horizon 5 rep 2" in rollout_run.progress
