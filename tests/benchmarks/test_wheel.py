"""The wheel ships the benchmarks (``mstar bench`` works from a regular install) and their
prompts, built from a copy of the sources so the checkout gains no build folders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mstar_async.cli.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
#: What the build reads: the project file, the readme it names, and the package (its
#: ``policies`` and ``engines`` are links to the top-level folders).
SOURCES = ("pyproject.toml", "README.md", "mstar_async", "policies", "engines")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools", reason="the build backend: pip install 'mstar-async[test]'")
    copy = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(source, copy / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, copy / name)
    dist = tmp_path_factory.mktemp("dist")
    # No build isolation: the build backend (setuptools) is the one installed here, so the
    # test needs no network.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "--quiet", str(copy), "-w", str(dist)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (built,) = dist.glob("mstar_async-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_has_every_benchmark_module_and_the_prompts(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for benchmark in BENCHMARKS.values():
        assert benchmark.module.replace(".", "/") + ".py" in names, benchmark.module
    for helper in ("__init__", "common", "report"):
        assert f"mstar_async/bench/{helper}.py" in names
    assert "mstar_async/bench/prompts/speech_en.txt" in names
    assert "mstar_async/bench/audio/stop.flac" in names  # the realtime bench's spoken turn
    assert not any(name.startswith(("benchmarks/", "tests/")) for name in names)


def test_the_wheel_has_the_linked_packages(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "mstar_async/engines/kv_engine.py" in names
    assert "mstar_async/policies/__init__.py" in names
