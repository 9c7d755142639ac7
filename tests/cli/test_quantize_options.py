"""``--quantize`` on ``mstar run`` and ``mstar serve``: passed to the builders that take a weight
form, refused, in one line, for models that take none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar_async.cli import main
from mstar_async.cli.main import build_parser
from mstar_async.cli.serve import _specs
from mstar_async.errors import MstarError
from tests.cli.test_errors import fails

pytestmark = pytest.mark.timeout(120)


def test_mstar_run_serves_the_quantized_form(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "causal-lm", "--path", str(tiny_folder), "--quantize", "int4", "--json"]
    assert main([*argv, "--prompt", "The capital", "--max-tokens", "4", "--ignore-eos", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["text"]


def test_mstar_run_refuses_unknown_forms_and_models_without_one(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fails(
        ["run", "causal-lm", "--path", str(tiny_folder), "--quantize", "fp8", "--prompt", "Hi"],
        capsys,
    )
    assert line == (
        "mstar run: cannot build causal-lm: quantize must be one of auto, none, int8, int4; "
        "got 'fp8'"
    )
    line = fails(["run", "demo", "--quantize", "int8"], capsys)
    assert line.startswith("mstar run: model 'demo' takes no --quantize (models that do: causal-lm")


def test_mstar_serve_gives_the_form_to_the_models_that_take_one(tiny_folder: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "causal-lm", "--path", str(tiny_folder), "--quantize", "int8", "--port", "0"]
    )
    (spec,) = _specs(args)
    assert spec.model.description.endswith("(int8 weights)")
    args = parser.parse_args(["serve", "demo", "--quantize", "int8", "--port", "0"])
    with pytest.raises(MstarError, match="--quantize: none of demo takes a weight form"):
        _specs(args)
