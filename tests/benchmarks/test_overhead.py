"""``mstar bench overhead`` at a tiny size: the report's shape and its figures' consistency.

No speed is asserted (the machine may be busy): only that every row and aim is there, that
every request-iteration was counted, and that the figures agree with one another.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest

from mstar_async.bench.overhead import (
    AIMS,
    ENGINES,
    BenchmarkError,
    OverheadConfig,
    format_report,
    preset,
)
from mstar_async.cli import main
from tests.benchmarks.runs import (
    OVERHEAD_CONCURRENCY,
    OVERHEAD_ITERATIONS,
    OVERHEAD_SYSTEMS,
    BenchRun,
)

# Two one-worker runtimes start (one per engine): a few seconds on two idle cores.
pytestmark = pytest.mark.timeout(120)

SYSTEMS = OVERHEAD_SYSTEMS
CONCURRENCY = OVERHEAD_CONCURRENCY
K = OVERHEAD_ITERATIONS


@pytest.fixture(scope="module")
def report(overhead_run: BenchRun) -> dict[str, Any]:
    # Progress went to stderr, and only JSON to stdout.
    assert "no-work N=2 repetition 1/1: one-worker" in overhead_run.progress
    return overhead_run.report


def test_shape(report: dict[str, Any]) -> None:
    assert set(report) == {
        "benchmark",
        "workload",
        "machine",
        "systems",
        "results",
        "aims",
        "seconds",
    }
    assert report["benchmark"] == "overhead"
    work = report["workload"]
    assert work["mode"] == "quick" and work["iterations"] == K and work["repeat"] == 1
    assert work["concurrency"] == list(CONCURRENCY) and work["engines"] == list(ENGINES)
    assert work["forward_ms"] == 2.0
    assert report["machine"]["cpu_count"] >= 1 and "load_average_end" in report["machine"]
    assert [s["name"] for s in report["systems"]] == list(SYSTEMS)
    assert [s["worker_processes"] for s in report["systems"]] == [0, 1]
    assert report["seconds"] > 0
    rows = {(r["engine"], r["system"], r["concurrency"]) for r in report["results"]}
    assert rows == {(e, s, n) for e in ENGINES for s in SYSTEMS for n in CONCURRENCY}
    assert len(report["results"]) == len(rows)


def test_every_request_iteration_counted(report: dict[str, Any]) -> None:
    for row in report["results"]:
        n = row["concurrency"]
        assert row["iterations"] == K and row["steps"] == n * K
        assert sum(row["steps_by_process"]) == n * K
        assert len(row["steps_by_process"]) == 1  # one engine process in both systems
        (sample,) = row["samples"]
        # Each request's iterations run one after another: at least K forwards, at most N*K
        # plus one per request for its step launched ahead of the loop's stop (a forward of
        # its own when the requests do not overlap) and the one the run before left unstamped.
        assert K <= sample["forwards"] <= n * (K + 1) + 1
        assert row["forwards"]["median"] == sample["forwards"]
        assert row["mean_batch"]["median"] == pytest.approx(n * K / sample["forwards"], 1e-3)


def test_figures_agree(report: dict[str, Any]) -> None:
    for row in report["results"]:
        (sample,) = row["samples"]
        steps, seconds = row["steps"], sample["seconds"]
        us = row["us_per_request_iteration"]["median"]
        assert us > 0 and row["rounds_per_s"]["median"] > 0
        assert us == pytest.approx(seconds / steps * 1e6, rel=1e-3, abs=1e-3)
        assert row["rounds_per_s"]["median"] == pytest.approx(
            sample["forwards"] / seconds, rel=1e-3
        )
        overhead = row["overhead_us_per_request_iteration"]["median"]
        if row["engine"] == "no-work":
            assert overhead == us
        else:
            # One engine process sleeps 2 ms per forward, one forward after another: the wall
            # time holds all of that sleep and something more.
            slept = sample["forwards"] * row["forward_ms_measured"] / 1e3
            assert row["forward_ms_measured"] >= 2.0  # a sleep never comes back early
            assert seconds > slept and 0 < overhead < us
            assert overhead == pytest.approx((seconds - slept) / steps * 1e6, rel=1e-3, abs=1e-2)


def test_aims(report: dict[str, Any]) -> None:
    assert len(report["aims"]) == len(AIMS)
    rows = {(r["engine"], r["system"], r["concurrency"]): r for r in report["results"]}
    for aim in report["aims"]:
        assert {"name", "target", "measured", "met"} <= set(aim) and aim["compare"] == "<="
        row = rows.get((aim["engine"], aim["system"], aim["concurrency"]))
        if row is None:  # N=32 and N=128 are not in this run
            assert aim["concurrency"] not in CONCURRENCY
            assert aim["measured"] is None and aim["met"] is None
        else:
            assert aim["measured"] == row[aim["metric"]]["median"]
            assert aim["met"] == (aim["measured"] <= aim["target"])


def test_text_report(report: dict[str, Any]) -> None:
    text = format_report(report)
    assert "no-work engine" in text and "fixed-cost engine (2 ms per forward)" in text
    assert text.count(" one-worker |") == 4 and text.count(" in-process |") == 4
    assert "not measured in this run" in text


def test_config_checks() -> None:
    assert preset(True).concurrency == (1, 32) and preset(False).concurrency == (1, 32, 128)
    with pytest.raises(BenchmarkError, match="systems"):
        OverheadConfig(systems=("elsewhere",))
    with pytest.raises(BenchmarkError, match="iterations"):
        OverheadConfig(iterations=0)
    with pytest.raises(BenchmarkError, match="concurrency"):
        OverheadConfig(concurrency=())


def test_cli_refuses_unknown_system() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["bench", "overhead", "--systems", "in-process,elsewhere"])
    assert "expected some of in-process,one-worker,two-workers" in err.getvalue()
