"""The image benchmark, run end to end through the CLI on the tiny model.

No timing is asserted: only that the report has every mode, task, concurrency, ratio and the
aim, and that the forked modes' KV block peaks are what the branch layout implies.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from benchmarks.image import AIM, TASKS, format_report
from mstar_async.cli import main
from mstar_async.models.bagel import CFG_MODES


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "image", "--quick", "--json", "--size", "tiny", "--steps", "2"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0
    assert "warmed up" in err.getvalue()
    parsed: dict[str, Any] = json.loads(out.getvalue())
    return parsed


@pytest.mark.timeout(120)
def test_report_has_every_mode_task_and_concurrency(report: dict[str, Any]) -> None:
    assert report["config"]["concurrency"] == [1, 2]
    assert report["config"]["steps"] == 2
    for task in TASKS:
        for mode in CFG_MODES:
            for n in ("1", "2"):
                entry = report["results"][task][mode][n]
                assert entry["p50_s"] > 0
                assert entry["requests"] == int(n)
                assert ("kv_peak_blocks" in entry) == (mode != "dense")
        for n in ("1", "2"):
            assert set(report["ratios"][task][n]) == {"dense/forked", "sequential/forked"}
            assert isinstance(report["aim"]["met"][task][n], bool)
    assert report["aim"]["dense/forked >="] == AIM
    assert "dense/forked" in format_report(report)


@pytest.mark.timeout(120)
def test_forked_kv_peaks_follow_the_branch_layout(report: dict[str, Any]) -> None:
    t2i = report["results"]["t2i"]
    # 64-token prompt (4 blocks), tiny image of 16 latent tokens: at N=1 the three branches'
    # scratch takes 1 block each (the prompt ends on a block boundary). At N=2 both prompts
    # are held, and the scratch of one or both requests (both when their steps batch).
    assert t2i["forked"]["1"]["kv_peak_blocks"] == 4 + 3
    assert 2 * 4 + 3 <= t2i["forked"]["2"]["kv_peak_blocks"] <= 2 * (4 + 3)
    # Sequential branches hold one branch's scratch at a time.
    assert t2i["sequential"]["1"]["kv_peak_blocks"] == 4 + 1
