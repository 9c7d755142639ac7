"""What the tests of workers that join over TCP share: ``mstar worker`` processes, free ports,
the demo split in two and its in-process answers, a quick launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.worker.remote import RemoteLauncher
from tests.worker.test_processes import EXAMPLES, run_demo

ROOT = Path(__file__).resolve().parents[2]
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
INPUTS = {"text": "over plain tcp", "max_codes": 16, "steps": 2, "seed": 3}
CODEC_SPLIT = Placement.from_yaml(EXAMPLES / "codec_split.yaml")


class Workers:
    """``mstar worker`` processes, their stderr kept in files (by name; default: the rank)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        port: int,
        rank: int,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        name: str | None = None,
    ) -> subprocess.Popen[bytes]:
        name = name or f"rank{rank}"
        command = [sys.executable, "-m", "mstar_async.cli", "worker"]
        command += ["--conductor", f"tcp://127.0.0.1:{port}", "--rank", str(rank)]
        with open(self.folder / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(
                [*command, "--threads", "1", *args],
                cwd=ROOT,
                stderr=err,
                env={**os.environ, **(env or {})},
            )
        self.procs[name] = proc
        return proc

    def stderr(self, key: int | str) -> str:
        name = f"rank{key}" if isinstance(key, int) else key
        return (self.folder / f"{name}.err").read_text()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def in_process() -> list[Any]:
    async with open_runtime(build_model("demo")) as runtime:
        return await run_demo(runtime, **INPUTS)


def launcher(port: int, **options: Any) -> RemoteLauncher:
    options.setdefault("heartbeat", 0.2)
    options.setdefault("timeout", 2.0)
    return RemoteLauncher(f"tcp://127.0.0.1:{port}", data_port=0, **options)
