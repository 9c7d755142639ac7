"""``mstar run pi05``: one action chunk, its shape, values and timing."""

from __future__ import annotations

import json

import pytest

from mstar_async.cli import main

pytestmark = pytest.mark.timeout(60)


def test_mstar_run_pi05_prints_the_action_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "pi05", "--steps", "2", "--instruction", "open the drawer"]) == 0
    out = capsys.readouterr().out
    assert "actions: 8x4 chunk, first values [" in out and "request took" in out


def test_mstar_run_pi05_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "pi05", "--json", "--steps", "3", "--seed", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["actions"] == [[8, 4]] and len(summary["action_values"]) == 6
    assert 0 < summary["seconds_total"]
