"""``/health/ready``: 503 saying why while a worker rank restarts or steps wait on a forward
that does not finish, 200 otherwise; ``/health`` stays 200 throughout (liveness)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.engines import Engine, Step, StepResult
from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.server import ModelSpec, create_app
from mstar_async.worker.walk_loop import WalkLoop
from tests.server.live import Reply, http, live_server

pytestmark = pytest.mark.timeout(180)

STALL_S = 0.3


class _Gate:
    """Wraps an engine: its forwards wait (on the forward thread) while the gate is shut."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.open = threading.Event()

    def cost(self, step: Step) -> int:
        return self.inner.cost(step)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        assert self.open.wait(60), "the test never opened the gate"
        return self.inner.forward(steps)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


@contextmanager
def gated(loop: WalkLoop, engine: str) -> Iterator[_Gate]:
    gate = _Gate(loop.engines[engine])
    loop.engines[engine] = gate  # the batching loop looks engines up per forward
    try:
        yield gate
    finally:
        gate.open.set()
        loop.engines[engine] = gate.inner


def poll(url: str, until: Callable[[Reply], bool], within: float) -> Reply:
    """GET ``url`` until ``until(reply)``; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not until(reply := http("GET", url, timeout=10)):
        assert time.monotonic() < deadline, f"{url} stayed {reply.status}: {reply.body!r}"
        time.sleep(0.02)
    return reply


def test_ready_answers_without_the_api_key(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    with live_server(create_app([ModelSpec(model)], api_key="k-1")) as url:
        reply = http("GET", f"{url}/health/ready")
        assert (reply.status, reply.json()) == (
            200,
            {"status": "ready", "models": {"causal-lm": {"ready": True}}},
        )
        assert http("GET", f"{url}/v1/models").status == 401


def test_a_forward_that_does_not_finish_makes_the_model_unready(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    app = create_app([ModelSpec(model)], stall_after_s=STALL_S)
    with live_server(app) as url, ThreadPoolExecutor(1) as pool:
        loop = app.state.server.models["causal-lm"].runtime.batching
        with gated(loop, "lm") as gate:
            body = {"model": "causal-lm", "prompt": "we", "max_tokens": 2}
            answer = pool.submit(http, "POST", f"{url}/v1/completions", body)
            reply = poll(f"{url}/health/ready", lambda r: r.status == 503, within=30)
            reason = reply.json()["models"]["causal-lm"]["reason"]
            assert "with no forward finishing" in reason and reply.json()["status"] == "unready"
            assert http("GET", f"{url}/health").status == 200  # alive all the same
            gate.open.set()
            assert answer.result(60).status == 200
        poll(f"{url}/health/ready", lambda r: r.status == 200, within=30)


def test_a_restarting_worker_rank_makes_the_model_unready() -> None:
    spec = ModelSpec(build_model("demo"), placement=Placement(nodes={"codec": 1}))
    app = create_app([spec])
    with live_server(app) as url:
        pool = app.state.server.models["demo"].runtime.pool
        poll(f"{url}/health/ready", lambda r: r.status == 200, within=30)
        victim = pool.pid(1)
        os.kill(victim, signal.SIGKILL)
        reply = poll(f"{url}/health/ready", lambda r: r.status == 503, within=30)
        # "worker rank 1 is restarting", or its death, when a ping saw it first.
        assert reply.json()["models"]["demo"]["reason"].startswith("worker rank 1 ")
        poll(f"{url}/health/ready", lambda r: r.status == 200, within=120)
        assert pool.restarts(1) == 1 and pool.pid(1) != victim


@pytest.mark.anyio
async def test_the_loop_counts_stalled_time_only_while_steps_wait(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    async with open_runtime(model) as runtime:
        loop = runtime.batching
        assert loop.stalled_s == 0.0
        with gated(loop, "lm") as gate:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run, runtime)
                with anyio.fail_after(30):
                    while loop.stalled_s < STALL_S:  # noqa: ASYNC110  (a clock: no event)
                        await anyio.sleep(0.02)
                gate.open.set()
        assert loop.stalled_s == 0.0  # nothing waits once the request is done


async def _run(runtime: Any) -> None:
    with anyio.fail_after(60):
        async with runtime.generate(prompt="we", max_tokens=2) as outputs:
            [item async for item in outputs]
