"""The image benchmark, run end to end through the CLI on the tiny model.

No timing is asserted: only that the report has every mode, task, concurrency, ratio and the
aim, and that the forked modes' KV block peaks are what the branch layout implies.
"""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.image import AIM, TASKS, format_report
from mstar_async.models.bagel import CFG_MODES
from tests.benchmarks.runs import BenchRun


@pytest.fixture(scope="module")
def report(image_run: BenchRun) -> dict[str, Any]:
    assert "warmed up" in image_run.progress
    return image_run.report


def _rows(report: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(row["task"], row["concurrency"]): row for row in report["results"]}


@pytest.mark.timeout(120)
def test_report_has_every_mode_task_and_concurrency(report: dict[str, Any]) -> None:
    assert report["workload"]["concurrency"] == [1, 2]
    assert report["workload"]["steps"] == 2
    assert [entry["name"] for entry in report["systems"]] == list(CFG_MODES)
    rows = _rows(report)
    assert list(rows) == [(task, n) for task in TASKS for n in (1, 2)]
    for (_, n), row in rows.items():
        for mode in CFG_MODES:
            entry = row["systems"][mode]
            assert entry["p50_s"] > 0
            assert entry["requests"] == n
            assert ("kv_peak_blocks" in entry) == (mode != "dense")
        assert set(row["ratios"]) == {"dense/forked", "sequential/forked"}
    aims = {(a["task"], a["concurrency"]): a for a in report["aims"]}
    assert set(aims) == set(rows)
    for key, entry in aims.items():
        assert entry["target"] == AIM and isinstance(entry["met"], bool)
        assert entry["measured"] == rows[key]["ratios"]["dense/forked"]["median"]
    assert "dense/forked" in format_report(report)


@pytest.mark.timeout(120)
def test_forked_kv_peaks_follow_the_branch_layout(report: dict[str, Any]) -> None:
    rows = _rows(report)
    one, two = rows[("t2i", 1)]["systems"], rows[("t2i", 2)]["systems"]
    # 64-token prompt (4 blocks), tiny image of 16 latent tokens: at N=1 the three branches'
    # scratch takes 1 block each (the prompt ends on a block boundary). At N=2 both prompts
    # are held, and the scratch of one or both requests (both when their steps batch).
    assert one["forked"]["kv_peak_blocks"] == 4 + 3
    assert 2 * 4 + 3 <= two["forked"]["kv_peak_blocks"] <= 2 * (4 + 3)
    # Sequential branches hold one branch's scratch at a time.
    assert one["sequential"]["kv_peak_blocks"] == 4 + 1
