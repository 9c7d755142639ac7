"""``mstar bench soak`` on a short run: samples over time, a settled server, every check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mstar_async.bench.soak import SoakConfig, format_report, run_soak_sync


@pytest.mark.timeout(120)
def test_a_short_soak_samples_over_time_and_settles_clean() -> None:
    lines: list[str] = []
    report = run_soak_sync(
        SoakConfig(minutes=0.05, sample_s=1.0, clients=3, models=("demo",)), lines.append
    )
    assert report["ok"], format_report(report)
    assert len(report["samples"]) >= 3  # the start, at least one under load, the last
    assert report["requests"] > 0 and report["failures"] == []
    assert report["settled"]["kv_blocks"] == 0 and report["settled"]["in_flight"] == 0
    assert any(line.startswith("t=") for line in lines)  # progress while it runs


def test_the_soak_refuses_a_duration_out_of_range() -> None:
    with pytest.raises(ValueError, match="minutes"):
        SoakConfig(minutes=0)
    result = subprocess.run(
        [sys.executable, "-m", "mstar_async.cli", "bench", "soak", "--minutes", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "expected minutes" in result.stderr


@pytest.mark.timeout(120)
def test_the_soak_command_prints_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mstar_async.cli", "bench", "soak", "--minutes", "0.03",
         "--sample-s", "1", "--clients", "2", "--models", "demo", "--json"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["benchmark"] == "soak" and report["ok"]
