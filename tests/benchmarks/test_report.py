"""The one shape of every benchmark's report: the checker itself, and every benchmark's
``mstar bench NAME --quick --json`` run (the session's shared runs) checked against it."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.report import REPORT_KEYS, aim_entry, check_report, make_report
from mstar_async.cli.bench import BENCHMARKS
from tests.benchmarks.runs import BenchRun

#: The slowest shared run (decode: both dtypes up to N = 32) takes about a minute on two idle
#: cores; whichever test here first asks for a run pays for it.
pytestmark = pytest.mark.timeout(420)


def _report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "x",
        "workload": {"n": 1},
        "machine": {"cpu_count": 2},
        "systems": [{"name": "a", "description": "the first"}],
        "results": [{"a": 1.0}],
        "aims": [aim_entry("a >= 1", 1.0, 2.0)],
        "seconds": 1.5,
    }
    report.update(changes)
    return report


@pytest.mark.slow  # every benchmark's run, fetched by name
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_quick_run_has_the_one_shape(name: str, request: pytest.FixtureRequest) -> None:
    run: BenchRun = request.getfixturevalue(f"{name}_run")
    check_report(run.report)
    assert list(run.report) == list(REPORT_KEYS)
    assert run.report["benchmark"] == name
    assert run.report["seconds"] > 0
    assert run.report["results"], "a run measures something"
    assert len({s["name"] for s in run.report["systems"]}) == len(run.report["systems"])
    assert len({a["name"] for a in run.report["aims"]}) == len(run.report["aims"])


def test_aims_are_judged_by_their_comparison() -> None:
    assert aim_entry("x", 10.0, 12.0)["met"] is True
    assert aim_entry("x", 10.0, 12.0, compare="<=")["met"] is False
    assert aim_entry("x", 1.0, 1.0, compare="<")["met"] is False
    unmeasured = aim_entry("x", 1.0, None, concurrency=32)
    assert unmeasured["met"] is None and unmeasured["concurrency"] == 32
    with pytest.raises(ValueError, match="compare"):
        aim_entry("x", 1.0, 1.0, compare="==")


def test_make_report_orders_and_checks() -> None:
    built = make_report(
        "x",
        workload={},
        machine={},
        systems=[],
        results=[],
        aims=[],
        seconds=0.123,
    )
    assert list(built) == list(REPORT_KEYS) and built["seconds"] == 0.12
    with pytest.raises(ValueError, match=r"systems\[0\] lacks \['description'\]"):
        make_report(
            "x", workload={}, machine={}, systems=[{"name": "a"}], results=[], aims=[], seconds=1
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seconds_total": 1.0}, r"unexpected \['seconds_total'\]"),
        ({"aims": {"a": 1}}, "aims must be a list"),
        ({"aims": [{"name": "a", "target": 1, "measured": 2}]}, r"aims\[0\] lacks \['met'\]"),
        ({"aims": [{"name": "a", "target": 1, "measured": None, "met": True}]}, "must be null"),
        ({"aims": [{"name": "a", "target": 1, "measured": 2, "met": None}]}, "true or false"),
        ({"aims": [aim_entry("a", 1, 2) | {"met": False}]}, "met is False"),
        ({"results": {"t2i": {}}}, "results must be a list"),
        ({"workload": []}, "workload must be an object"),
        ({"seconds": "1"}, "seconds must be a number"),
        ({"benchmark": ""}, "benchmark must be a name"),
        ({"results": [{"x": object()}]}, "not JSON"),
    ],
)
def test_check_report_names_what_breaks_the_shape(changes: dict[str, Any], message: str) -> None:
    report = _report(**changes)
    if "seconds_total" in changes:
        del report["seconds"]
    check_report(_report())
    with pytest.raises(ValueError, match=message):
        check_report(report)
