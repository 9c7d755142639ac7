"""Prefill/decode disaggregation: a request prefills on rank 0 and decodes on rank 1, its KV
moving worker to worker as the decode walk starts, never through the conductor; a cancel during
the move frees it on both ranks, and the loss of the rank it comes from fails the request."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.errors import RequestError, WorkerLost
from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.worker.pool import WorkerPool
from tests.requests import collect_text
from tests.worker.models import build_slow_moving_lm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
PROMPTS = ["The capital of France is", "def main():", "we'll see what they're saying"]
SPLIT = Placement.from_yaml(EXAMPLES / "prefill_decode.yaml")


def causal_lm(folder: Path) -> Any:
    return build_model("causal-lm", path=str(folder), dtype="float32")


async def held(pool: WorkerPool, within: float = 10.0) -> list[tuple[int, int]]:
    """Each rank's KV blocks and requests held: as soon as none holds anything, else as they
    are after ``within`` seconds (a move's export or import in flight finishes first)."""
    deadline = anyio.current_time() + within
    while True:
        now = []
        for rank in sorted(pool.ranks):
            stats = await pool.worker_stats(rank)
            now.append((stats["kv_blocks"], stats["requests_held"]))
        if all(n == (0, 0) for n in now) or anyio.current_time() > deadline:
            return now
        await anyio.sleep(0.05)


async def moving(pool: WorkerPool) -> None:
    """Wait until some walk is taking its request's state from another rank."""
    with anyio.fail_after(30):
        while not pool._moving:  # noqa: ASYNC110  (the pool's own state, changed by messages)
            await anyio.sleep(0.005)


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_prefill_decode_split_moves_the_kv_worker_to_worker_and_changes_no_token(
    tiny_folder: Path,
) -> None:
    requests = [dict(prompt=p, max_tokens=16) for p in PROMPTS]
    async with open_runtime(causal_lm(tiny_folder)) as runtime:
        expected = [await collect_text(runtime, **r) for r in requests]
    async with open_runtime(causal_lm(tiny_folder), placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        got: dict[int, str] = {}

        async def one(i: int) -> None:
            got[i] = await collect_text(runtime, **requests[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
        assert [got[i] for i in range(len(requests))] == expected
        assert all(expected)
        # Each request's KV left rank 0 for rank 1 directly; the conductor sent walks only and
        # received their outputs, not one step message nor one byte of state.
        src, dst = await pool.worker_stats(0), await pool.worker_stats(1)
        assert src["state_moves_out"] == dst["state_moves_in"] == len(requests)
        assert dst["state_bytes_in"] > 0
        traffic = pool.stats()
        assert traffic.step_messages == 0 and traffic.state_bytes == 0
        assert traffic.bytes_received < dst["state_bytes_in"]
        assert set(traffic.messages_sent) <= {"Peers", "StartWalk", "WalkCredit", "Release", "Ping"}
        assert set(traffic.messages_received) <= {"Hello", "WalkUpdates", "Pong"}
        assert traffic.messages_sent["StartWalk"] == 2 * len(requests)  # prefill, decode
        # Nothing is left on either rank: the source freed each request's blocks once the
        # destination had them, and the destination when the request ended.
        assert await held(pool) == [(0, 0), (0, 0)]


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow", ["export", "import"])
async def test_a_cancel_during_the_move_frees_the_kv_on_both_ranks(
    tiny_folder: Path, slow: str
) -> None:
    # "export": cancelled while rank 1 waits for the state; "import": while it lands there.
    model = build_slow_moving_lm(str(tiny_folder), slow, 1.0)
    async with open_runtime(model, placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        with anyio.fail_after(60):
            async with runtime.generate(prompt=PROMPTS[0] * 8, max_tokens=16) as outputs:
                await moving(pool)
                await anyio.sleep(0.3)  # the slow side is at work now
                await outputs.aclose()
        assert not runtime.conductor.active
        assert await held(pool) == [(0, 0), (0, 0)]
        assert (await pool.worker_stats(1))["state_moves_in"] == 0  # it never landed
        # The runtime serves the next request as before, its KV moved.
        assert await collect_text(runtime, prompt=PROMPTS[1], max_tokens=4)
        assert (await pool.worker_stats(1))["state_moves_in"] == 1
        assert await held(pool) == [(0, 0), (0, 0)]


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_losing_the_rank_the_kv_comes_from_fails_the_walk_with_worker_lost(
    tiny_folder: Path,
) -> None:
    model = build_slow_moving_lm(str(tiny_folder), "export", 3.0)
    async with open_runtime(model, placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        victim = pool.pid(0)
        assert victim is not None
        with anyio.fail_after(60), pytest.raises(RequestError) as caught:
            async with runtime.generate(prompt=PROMPTS[0], max_tokens=16) as outputs:
                await moving(pool)
                os.kill(victim, signal.SIGKILL)
                async for _ in outputs:
                    pass
        assert isinstance(caught.value.__cause__, WorkerLost)
        assert "worker rank 0" in str(caught.value.__cause__)
        await restarted(runtime, victim)
        assert await held(pool) == [(0, 0), (0, 0)]


async def restarted(runtime: Runtime, victim: int) -> None:
    pool = runtime.pool
    assert pool is not None
    with anyio.fail_after(60):
        while pool.pid(0) in (None, victim) or pool.unready_ranks():  # noqa: ASYNC110
            await anyio.sleep(0.05)
