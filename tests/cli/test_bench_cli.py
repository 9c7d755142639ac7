"""``mstar bench`` as a command: which benchmarks it lists, what it says when a benchmark's
packages are missing, and that the CLI and the benchmarks do not import each other."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from mstar_async.cli import bench as bench_cli
from mstar_async.cli import main

pytestmark = pytest.mark.timeout(60)


def _hide(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make ``find_spec`` say ``packages`` are not installed, as in an install without them."""
    real: Callable[..., Any] = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in packages else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_installed_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    listed = _help(capsys)
    for name in bench_cli.BENCHMARKS:
        assert f"    {name}" in listed


def test_help_lists_only_benchmarks_whose_module_exists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = bench_cli.Benchmark("mstar_async.bench.not_shipped")
    monkeypatch.setitem(bench_cli.BENCHMARKS, "ghost", missing)
    assert not bench_cli.available("ghost")
    assert "ghost" not in _help(capsys)


def test_a_missing_extra_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "transformers")
    listed = " ".join(_help(capsys).split())  # as one line: argparse wraps the help
    assert "hand-written engine loop [needs pip install 'mstar-async[bench]']" in listed
    assert main(["bench", "decode", "--quick", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "mstar bench decode: it needs transformers, which is not installed: "
        "pip install 'mstar-async[bench]'\n"
    )


def test_a_plot_without_matplotlib_is_refused_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "matplotlib")
    assert main(["bench", "rollout", "--quick", "--plot", "x.png"]) == 2
    assert capsys.readouterr().err == (
        "mstar bench rollout: --plot needs matplotlib, which is not installed: "
        "pip install 'mstar-async[bench]'\n"
    )


def test_a_benchmark_module_failing_to_import_names_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(name: str) -> Any:
        raise ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")

    monkeypatch.setattr(bench_cli.importlib, "import_module", fail)
    with pytest.raises(bench_cli.MissingExtra, match=r"needs matplotlib, .*\[bench\]"):
        bench_cli.load_benchmark("vla")


def test_the_cli_and_the_benchmarks_do_not_import_each_other() -> None:
    modules = [b.module for b in bench_cli.BENCHMARKS.values()]
    script = (
        "import sys\n"
        "from mstar_async.cli.main import build_parser\n"
        "build_parser()\n"
        "assert not [m for m in sys.modules if m.startswith('mstar_async.bench.')], sys.modules\n"
        "for name in [m for m in sys.modules if m.startswith('mstar_async.cli')]:\n"
        "    del sys.modules[name]\n"
        f"for module in {modules!r}:\n"
        "    __import__(module)\n"
        "assert not [m for m in sys.modules if m.startswith('mstar_async.cli')]\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
