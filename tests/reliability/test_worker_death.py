"""``kill -9`` of a worker process while ``mstar serve`` streams through it: the requests on it
end, readiness says 503 until the rank is back, then the server answers again, and no worker
process outlives the server."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import anyio
import pytest

from mstar_async.errors import RequestError, WorkerLost
from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.worker.launchers import LocalLauncher, WorkerHandle
from mstar_async.worker.main import WorkerConfig
from tests.server.live import http as request
from tests.server.process import alive, children, mstar_serve
from tests.worker.test_processes import assert_same, run_demo

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
LONG = {"model": "demo", "inputs": {"text": "long", "max_codes": 100_000, "steps": 2}}
SHORT = {"model": "demo", "inputs": {"text": "short", "max_codes": 8, "steps": 1}}


def _stream(url: str, started: threading.Event, ended: list[float]) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        body = json.dumps(LONG)
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.readline()
        started.set()
        while reply.readline():
            pass
    except (OSError, http.client.HTTPException):
        pass
    finally:
        started.set()
        ended.append(time.monotonic())
        conn.close()


def _wait_status(url: str, status: int, within: float) -> float:
    deadline = time.monotonic() + within
    while True:
        reply = request("GET", f"{url}/health/ready", timeout=5)
        if reply.status == status:
            return time.monotonic()
        assert time.monotonic() < deadline, f"/health/ready stayed {reply.status}: {reply.body!r}"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_kill_9_of_a_worker_under_load_ends_its_streams_and_the_server_recovers() -> None:
    placement = str(EXAMPLES / "codec_split.yaml")
    with mstar_serve("demo", "--placement", placement, ready_within=120) as (url, process):
        _wait_status(url, 200, within=60)
        workers = children(process.pid)
        assert len(workers) == 2
        ended: list[float] = []
        threads = []
        for _ in range(3):
            started = threading.Event()
            thread = threading.Thread(target=_stream, args=(url, started, ended), daemon=True)
            thread.start()
            assert started.wait(60)
            threads.append(thread)
        killed_at = time.monotonic()
        os.kill(workers[-1], signal.SIGKILL)
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a stream through the dead worker never ended"
        assert max(ended) - killed_at < 30
        _wait_status(url, 200, within=120)  # the rank restarted
        reply = request("POST", f"{url}/generate", SHORT, timeout=120)
        assert reply.status == 200, reply.body[:300]
        survivors = [pid for pid in children(process.pid) if pid not in workers]
        assert len(children(process.pid)) == 2 and survivors  # a new worker took the rank
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    everyone = [*workers, *survivors]
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in everyone), "a worker process outlived the server"


class SlowReplacement:
    """Local workers whose replacements wait for ``gate``: what a cluster does while no node can
    take a lost rank (Ray starts the new actor once a node with its resources joins)."""

    curve_keys = None

    def __init__(self) -> None:
        self.inner = LocalLauncher()
        self.gate = anyio.Event()

    async def open(self) -> str | None:
        return await self.inner.open()

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        if config.generation > 1:
            await self.gate.wait()
        return await self.inner.start(config)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_rank_lost_and_not_yet_replaced_fails_what_needs_it_at_once() -> None:
    launcher = SlowReplacement()
    placement = Placement(nodes={"codec": 1})
    inputs = {"text": "short", "max_codes": 8, "steps": 1}
    async with open_runtime(build_model("demo"), placement=placement, launcher=launcher) as rt:
        pool = rt.pool
        assert pool is not None
        expected = await run_demo(rt, **inputs)
        victim = pool.pid(1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        with anyio.fail_after(30):
            while pool.unready_ranks() != {1: "is restarting"}:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        with anyio.fail_after(2):  # not the pool's ready_timeout (180 s)
            with pytest.raises(WorkerLost, match="worker rank 1 was lost and is restarting"):
                await pool.worker_stats(1)
            with pytest.raises(RequestError, match="worker rank 1"):
                await run_demo(rt, **inputs)
        launcher.gate.set()
        with anyio.fail_after(60):
            while pool.unready_ranks():  # noqa: ASYNC110  (the new worker's start)
                await anyio.sleep(0.05)
        assert_same(await run_demo(rt, **inputs), expected)
