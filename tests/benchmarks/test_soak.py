"""``mstar bench soak`` on a short run: samples over time, a settled server, every check."""

from __future__ import annotations

import pytest

from mstar_async.bench.soak import SoakConfig, format_report, preset, run_soak_sync
from tests.benchmarks.runs import BenchRun


@pytest.mark.timeout(120)
def test_a_short_soak_samples_over_time_and_settles_clean() -> None:
    lines: list[str] = []
    config = SoakConfig(minutes=0.05, sample_s=1.0, clients=3, models=("demo",))
    report = run_soak_sync(config, lines.append)
    assert all(aim["met"] for aim in report["aims"]), format_report(report)
    rows = report["results"]
    assert [r["phase"] for r in rows].count("load") >= 3  # the start, under load, the last
    settled = rows[-1]
    assert settled["phase"] == "settled" and settled["requests"] > 0
    assert settled["failures"] == [] and settled["kv_blocks"] == 0 == settled["in_flight"]
    assert any(line.startswith("t=") for line in lines)  # progress while it runs


def test_the_soak_refuses_a_duration_out_of_range() -> None:
    with pytest.raises(ValueError, match="minutes"):
        SoakConfig(minutes=0)
    assert preset(quick=True).models == ("demo",)


@pytest.mark.timeout(300)
def test_the_soak_command_prints_the_report(soak_run: BenchRun) -> None:
    assert soak_run.report["benchmark"] == "soak"
    assert all(aim["met"] for aim in soak_run.report["aims"])
    assert "settled:" in soak_run.progress
