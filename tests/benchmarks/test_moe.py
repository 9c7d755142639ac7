"""The MoE benchmark, run once small: no timing is asserted (the machine may be busy), only
that every shape and token count is measured on both systems, that they agree, the JSON shape,
the text report and the command line's options."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.moe import MoEConfig, format_report, run_moe
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def report(moe_run: BenchRun) -> dict[str, Any]:
    return moe_run.report


def test_every_token_count_is_measured_on_both_systems_and_they_agree(
    report: dict[str, Any],
) -> None:
    assert [s["name"] for s in report["systems"]] == ["batched", "loop"]
    assert [(r["shape"], r["tokens"]) for r in report["results"]] == [("small", 1), ("small", 3)]
    for row in report["results"]:
        assert row["batched_ms"]["n"] == row["loop_ms"]["n"] == row["loop/batched"]["n"] == 2
        assert row["batched_ms"]["median"] > 0 and row["loop_ms"]["median"] > 0
        assert row["max_abs_diff"] <= 1e-5
        assert 1 <= row["experts_used"] <= 2 * row["tokens"]
    assert report["workload"]["shapes"]["small"] == {
        "experts": 8,
        "top_k": 2,
        "hidden": 256,
        "width": 128,
    }


def test_the_text_report_has_a_line_per_row(report: dict[str, Any], moe_run: BenchRun) -> None:
    assert len(format_report(report).splitlines()) == 2 + len(report["results"])
    assert "small    3 tokens" in moe_run.progress


def test_an_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown shapes"):
        run_moe(MoEConfig(shapes=("huge",)))
