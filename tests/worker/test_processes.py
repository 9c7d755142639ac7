"""Worker processes: same answers under every placement, kill -9 recovery, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.errors import RequestError, WorkerLost
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from tests.children import running
from tests.server.process import alive

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


async def run_demo(runtime: Any, **inputs: Any) -> list[Any]:
    with anyio.fail_after(120):
        async with runtime.generate(**inputs) as outputs:
            return [item async for item in outputs]


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert [type(x) for x in a] == [type(x) for x in b]
    for x, y in zip(a, b, strict=True):
        if isinstance(x, AudioChunk):
            # Worker ranks get their own share of the cores: float results may differ in the
            # last bits from thread-count-dependent reductions, never more.
            torch.testing.assert_close(x.pcm, y.pcm, atol=1e-6, rtol=0)
        else:
            assert isinstance(x, ImageOutput)
            torch.testing.assert_close(x.image, y.image, atol=1e-6, rtol=0)


def wait_gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.anyio
@ONE_LOOP  # the workers' transport is what differs here, not the conductor's event loop
async def test_same_answers_in_process_one_worker_and_codec_split() -> None:
    inputs = {"text": "same answers", "max_codes": 24, "steps": 4, "seed": 7}
    results = []
    for placement in (None, Placement.single(), Placement.from_yaml(EXAMPLES / "codec_split.yaml")):
        async with open_runtime(build_model("demo"), placement=placement) as runtime:
            results.append(await run_demo(runtime, **inputs))
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])


@ONE_LOOP
@pytest.mark.anyio
async def test_kill_9_fails_that_workers_requests_and_the_runtime_recovers() -> None:
    placement = Placement.from_yaml(EXAMPLES / "replicas.yaml")  # codec on ranks 1 and 2
    async with open_runtime(build_model("demo"), placement=placement) as runtime:
        pool = runtime.pool
        assert pool is not None
        expected = await run_demo(runtime, text="before", max_codes=16, steps=2)
        victim_pid = pool.pid(1)
        assert victim_pid is not None
        results: dict[str, Any] = {}

        async def consume(name: str, **inputs: Any) -> None:
            try:
                results[name] = await run_demo(runtime, **inputs)
            except RequestError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            # Two long requests: the router puts one on each codec replica.
            tg.start_soon(lambda: consume("a", text="long a", max_codes=4000, steps=2))
            tg.start_soon(lambda: consume("b", text="long b", max_codes=300, steps=2))
            with anyio.fail_after(60):
                while pool.restarts(1) == 0 and len(results) < 2:
                    if runtime.conductor.active and all(
                        r.context is not None for r in runtime.conductor.active.values()
                    ):
                        os.kill(victim_pid, signal.SIGKILL)
                        break
                    await anyio.sleep(0.05)
        lost = [r for r in results.values() if isinstance(r, RequestError)]
        done = [r for r in results.values() if isinstance(r, list)]
        assert len(lost) == 1 and len(done) == 1
        assert isinstance(lost[0].__cause__, WorkerLost)
        assert "worker rank 1" in str(lost[0].__cause__)
        # The rank came back and the runtime serves new requests.
        with anyio.fail_after(120):
            while pool.pid(1) in (None, victim_pid):  # noqa: ASYNC110  (another process's state)
                await anyio.sleep(0.05)
        assert pool.restarts(1) == 1
        assert_same(await run_demo(runtime, text="before", max_codes=16, steps=2), expected)


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_walk_started_while_its_rank_restarts_runs_once_the_rank_is_back() -> None:
    async with open_runtime(build_model("noop"), placement=Placement.single()) as runtime:
        pool = runtime.pool
        assert pool is not None
        victim = pool.pid(0)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        with anyio.fail_after(60):
            while pool.pid(0) in (None, victim):  # noqa: ASYNC110  (another process's state)
                await anyio.sleep(0.01)
        # The new worker is still starting (importing, building its engines): the walk's
        # start waits for it instead of failing on a connection not yet made.
        assert not pool.ranks[0].ready.is_set()
        with anyio.fail_after(60):
            async with runtime.generate(iterations=3) as outputs:
                assert len([item async for item in outputs]) == 3


@ONE_LOOP
@pytest.mark.anyio
async def test_closing_the_runtime_stops_every_worker() -> None:
    async with open_runtime(build_model("demo"), placement=Placement(nodes={"codec": 1})) as rt:
        assert rt.pool is not None
        pids = [rt.pool.pid(0), rt.pool.pid(1)]
    assert all(p is not None for p in pids)
    assert wait_gone([p for p in pids if p is not None], seconds=1.0)


@contextmanager
def _parent() -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """``parent.py`` running, with SIGINT at its default (see ``tests.children``), and the
    pids of its two workers; the parent is ended however the test ends."""
    script = str(Path(__file__).with_name("parent.py"))
    cwd = Path(__file__).resolve().parents[2]
    with running([sys.executable, script], stdout=subprocess.PIPE, text=True, cwd=cwd) as parent:
        assert parent.stdout is not None
        pids: list[int] = json.loads(parent.stdout.readline())
        assert all(alive(p) for p in pids)
        try:
            yield parent, pids
        finally:
            for pid in pids:  # workers of a parent that failed to stop them
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_workers_die_with_a_parent_killed_by_sigkill() -> None:
    with _parent() as (parent, pids):
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(pids), f"orphaned workers: {[p for p in pids if alive(p)]}"


def test_ctrl_c_shuts_the_workers_down() -> None:
    with _parent() as (parent, pids):
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=30) == 130
        assert wait_gone(pids, seconds=5.0), f"orphaned workers: {[p for p in pids if alive(p)]}"
