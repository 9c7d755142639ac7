"""``mstar bench vla`` end to end on the tiny policy: the report's figures are consistent.

No timing is asserted, only that every figure is there, counted and self-consistent.
"""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.vla import VlaConfig, format_vla, preset, request_inputs
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def report(vla_run: BenchRun) -> dict[str, Any]:
    assert "N=3 repetition 1/1" in vla_run.progress  # progress goes to stderr
    return vla_run.report


def test_report_has_both_modes_at_each_concurrency(report: dict[str, Any]) -> None:
    work = report["workload"]
    assert work["size"] == "tiny" and work["steps"] == 2 and work["threads"] == 1
    assert work["action_chunk"] == [8, 4]
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    assert [s["name"] for s in report["systems"]] == ["concurrent", "sequential"]
    assert report["aims"] == []  # no target is set for this benchmark
    # Three concurrent requests' flow steps ran in one forward at least once.
    assert work["largest_flow_step_batch"] == 3
    for entry in report["results"]:
        (rep,) = entry["repetitions"]
        for mode in ("concurrent", "sequential"):
            figures = rep[mode]
            assert 0 < figures["p50_ms"] <= figures["p95_ms"]
            n = entry["concurrency"]
            assert figures["chunks_per_s"] == pytest.approx(n / figures["seconds"], rel=1e-2)
        ratio = rep["concurrent"]["chunks_per_s"] / rep["sequential"]["chunks_per_s"]
        assert entry["throughput_ratio"]["median"] == pytest.approx(ratio, rel=1e-3)


def test_text_report_has_a_row_per_concurrency(report: dict[str, Any]) -> None:
    text = format_vla(report)
    rows = [line for line in text.splitlines() if line.strip().startswith(("1 |", "3 |"))]
    assert len(rows) == 2 and "chunks/s" in text


def test_presets_and_inputs() -> None:
    assert preset(True) == VlaConfig(size="tiny", repeat=1)
    assert preset(False).concurrency == (1, 4, 16) and preset(False).size == "small"
    assert request_inputs(7, 10) == {
        "instruction": request_inputs(1, 10)["instruction"],
        "seed": 7,
        "steps": 10,
    }
    with pytest.raises(ValueError, match="must be >= 1"):
        VlaConfig(concurrency=(0,))
