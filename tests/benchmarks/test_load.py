"""The load benchmark, run once on a small checkpoint: no timing or memory figure is asserted
(the machine may be busy), only what each row says was read, the aims, the JSON shape, the text
report and the command line."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.load import RANKS, format_report
from mstar_async.cli import main
from tests.benchmarks.runs import BenchRun

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def report(load_run: BenchRun) -> dict[str, Any]:
    return load_run.report


def test_each_rank_reads_its_weights_and_the_baseline_reads_everything(
    report: dict[str, Any],
) -> None:
    rows = {(r["system"], r["rank"]): r for r in report["results"]}
    assert list(rows) == [("streamed", "all"), ("streamed", "talker"), ("eager", "all")]
    stored = report["workload"]["checkpoint_bytes"]
    every, talker, eager = rows.values()
    assert every["bytes_read"] == every["weights_bytes"] < stored  # the towers are not read
    assert talker["bytes_read"] == talker["weights_bytes"] < every["weights_bytes"]
    assert eager["bytes_read"] == stored and eager["tensors_read"] == report["workload"]["tensors"]
    assert [load["part"] for load in every["loads"]] == ["thinker", "talker", "code2wav"]
    assert [load["part"] for load in talker["loads"]] == ["talker"]
    assert talker["thinker_bytes_read"] == 0 < every["thinker_bytes_read"]
    assert talker["parts"] == list(RANKS["talker"])
    for row in rows.values():
        assert row["peak_rss_growth_bytes"] > 0 and row["seconds"] > 0


def test_the_aims_are_per_streamed_rank_plus_the_talkers_thinker_reads(
    report: dict[str, Any],
) -> None:
    names = [aim["name"] for aim in report["aims"]]
    assert names == [
        "all: peak RSS growth <= 1.3x weights + 200 MB (MB)",
        "talker: peak RSS growth <= 1.3x weights + 200 MB (MB)",
        "talker: thinker bytes read",
    ]
    thinker = report["aims"][2]
    assert thinker["measured"] == thinker["target"] == 0 and thinker["met"] is True


def test_the_text_report_has_a_line_per_row_and_aim(
    report: dict[str, Any], load_run: BenchRun
) -> None:
    text = format_report(report)
    assert len(text.splitlines()) == 2 + len(report["results"]) + len(report["aims"])
    assert "streamed  talker" in text and "eager     all" in text
    assert "streamed talker: loading" in load_run.progress


@pytest.mark.parametrize(
    ("argv", "words"),
    [(["--ranks", "all,nope"], "expected some of"), (["--size-gb", "0.01"], "gigabytes")],
)
def test_bad_options_are_refused(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "load", *argv])
    assert exited.value.code == 2 and words in capsys.readouterr().err
