"""The benchmark harness's pure helpers, against hand-computed values."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest

from mstar_async.bench.common import (
    CpuSample,
    ProgressLog,
    Summary,
    child_pids,
    cpu_sample,
    foreign_cores,
    percentile,
    process_cpu_seconds,
    ratio_table,
    summarize,
)


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # rank 1.5: halfway between 2 and 3
    assert percentile(values, 25) == 1.75  # rank 0.75
    assert percentile([7.0], 90) == 7.0
    assert percentile([10.0, 20.0, 30.0], 50) == 20.0


def test_percentile_rejects_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize_gives_median_min_max_and_count() -> None:
    assert summarize([3.0, 1.0, 2.0]) == Summary(2.0, 1.0, 3.0, 3)
    assert summarize([5.0, 1.0]) == Summary(3.0, 1.0, 5.0, 2)
    assert Summary(1.23456, 1.0, 2.0, 2).to_json() == {
        "median": 1.2346,
        "min": 1.0,
        "max": 2.0,
        "n": 2,
    }
    with pytest.raises(ValueError):
        summarize([])


def test_ratio_table_divides_within_each_round_then_summarises() -> None:
    rounds = [
        {"runtime": 100.0, "transformers": 10.0, "handloop": 125.0},
        {"runtime": 60.0, "transformers": 20.0, "handloop": 50.0},
        {"runtime": 80.0, "transformers": 10.0, "handloop": 100.0},
    ]
    table = ratio_table(rounds, [("runtime", "transformers"), ("runtime", "handloop")])
    assert list(table) == ["runtime/transformers", "runtime/handloop"]
    # Per round: 10, 3, 8 -> median 8 (the ratio of medians would be 80 / 10 = 8 as well,
    # but the spread is the per-round one).
    assert table["runtime/transformers"] == Summary(8.0, 3.0, 10.0, 3)
    assert table["runtime/handloop"] == Summary(0.8, 0.8, 1.2, 3)


def test_ratio_table_rejects_missing_systems_and_zero_denominators() -> None:
    with pytest.raises(ValueError, match="lacks"):
        ratio_table([{"runtime": 1.0}], [("runtime", "handloop")])
    with pytest.raises(ValueError, match="not > 0"):
        ratio_table([{"runtime": 1.0, "handloop": 0.0}], [("runtime", "handloop")])
    with pytest.raises(ValueError, match="no rounds"):
        ratio_table([], [("runtime", "handloop")])


def test_progress_log_stamps_lines_on_its_stream() -> None:
    stream = io.StringIO()
    ProgressLog(stream)("loading")
    line = stream.getvalue()
    assert line.endswith("s] loading\n") and line.startswith("[")


def test_foreign_cores_is_busy_time_not_ours_over_wall_time() -> None:
    start = CpuSample(wall=10.0, busy=100.0, own=40.0)
    # 4 s of wall time: all CPUs were busy 7 s, 5 s of it ours -> others kept 0.5 cores busy.
    assert foreign_cores(start, CpuSample(wall=14.0, busy=107.0, own=45.0)) == 0.5
    # Clock ticks can make our own time exceed the total a little: never below zero.
    assert foreign_cores(start, CpuSample(wall=14.0, busy=104.0, own=44.5)) == 0.0
    assert foreign_cores(start, CpuSample(wall=14.0, busy=None, own=45.0)) is None
    assert foreign_cores(start, CpuSample(wall=10.0, busy=100.0, own=40.0)) is None


def test_cpu_sample_reads_monotonic_clocks() -> None:
    first = cpu_sample()
    sum(range(200_000))  # some CPU time of our own
    second = cpu_sample()
    assert second.wall > first.wall and second.own >= first.own
    if first.busy is not None and second.busy is not None:
        assert second.busy >= first.busy


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_child_processes_and_their_cpu_time() -> None:
    busy = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy + "\ntime.sleep(5)"])
    try:
        assert child.pid in child_pids()
        deadline = time.monotonic() + 10
        while process_cpu_seconds(child.pid) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_cpu_seconds(child.pid) >= 0.2
        # A child's CPU time counts as this process's own when named.
        assert cpu_sample([child.pid]).own >= cpu_sample().own + 0.15
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        process_cpu_seconds(child.pid)
    assert child.pid not in child_pids()
