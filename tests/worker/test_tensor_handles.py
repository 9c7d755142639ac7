"""Large tensors go worker to worker: the conductor forwards handles, never the bytes, and every
worker's store is empty once its requests are over, finished or cancelled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.transport import StartWalk, generate_curve_keys
from mstar_async.worker.launchers import LocalLauncher
from mstar_async.worker.pool import WorkerPool

from .models import HANDOFF_SIDE, build_handoff

H_BYTES = HANDOFF_SIDE * HANDOFF_SIDE * 4
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
# make and check on rank 0, use on rank 1: h crosses once between workers and once not at all.
SPLIT = Placement(nodes={"use": 1, "use2": 1})


async def collect(runtime: Runtime, **inputs: Any) -> list[Any]:
    with anyio.fail_after(60):
        async with runtime.generate(**inputs) as outputs:
            return [item async for item in outputs]


async def stats(pool: WorkerPool) -> list[dict[str, int]]:
    return [await pool.worker_stats(rank) for rank in sorted(pool.ranks)]


async def settled(pool: WorkerPool) -> list[dict[str, int]]:
    """Every worker's counters once no walk runs there any more (cancelled walks end late)."""
    with anyio.fail_after(20):
        while True:
            now = await stats(pool)
            if all(s["walks"] == 0 for s in now):
                return now
            await anyio.sleep(0.05)


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_a_large_tensor_goes_worker_to_worker_and_the_conductor_never_holds_it() -> None:
    async with open_runtime(build_handoff()) as local:
        expected = await collect(local, x=0.5)
        expected_raw = await collect(local, x=0.25, raw=True)
        expected_loop = await collect(local, x=0.75, loop=True)
    async with open_runtime(build_handoff(), placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        before = pool.bytes_received
        answer = await collect(runtime, x=0.5)
        through_conductor = pool.bytes_received - before
        after = await stats(pool)
        # The same answers, bit for bit (one op, same inputs, same code on every rank).
        for got, want in zip(answer, expected, strict=True):
            assert torch.equal(got, want)
        # h (64 KiB) reached rank 1 straight from rank 0, and rank 0's check read its own copy.
        assert through_conductor < H_BYTES // 8
        assert after[0]["tensors_served"] == 1 and after[0]["tensors_fetched"] == 0
        assert after[1]["tensors_fetched"] == 1
        assert [s["tensors_held"] for s in after] == [0, 0]  # released when the request ended

        # Where the program itself receives h, the conductor fetches it then, and only then.
        before = pool.bytes_received
        (raw,) = await collect(runtime, x=0.25, raw=True)
        assert pool.bytes_received - before >= H_BYTES
        assert torch.equal(raw, expected_raw[0])
        assert [s["tensors_held"] for s in await stats(pool)] == [0, 0]

        # A loop on rank 0 carries h there, and rank 1 fetches the last one. Its predicate
        # reads each iteration's h on rank 0, where the loop runs: no h crosses the conductor.
        before = pool.bytes_received
        (looped,) = await collect(runtime, x=0.75, loop=True)
        assert torch.equal(looped, expected_loop[0])
        crossed = pool.bytes_received - before
        assert crossed < H_BYTES // 8
        assert pool.stats().step_messages == 0
        now = await stats(pool)
        assert now[1]["tensors_fetched"] == 2
        assert [s["tensors_held"] for s in now] == [0, 0]


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_stores_are_empty_after_finished_and_cancelled_requests() -> None:
    async with open_runtime(build_handoff(), placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        answers: list[list[Any]] = []

        async def one(x: float) -> None:
            answers.append(await collect(runtime, x=x))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, float(i))
        assert [len(a) for a in answers] == [2] * 4
        # Cancelled while its slow make step runs: that step finishes after the release and
        # must keep nothing.
        with anyio.move_on_after(0.3) as scope:
            await collect(runtime, x=-1.0)
        assert scope.cancelled_caught
        # Closed by its client after the first output, with h still held on rank 0.
        async with runtime.generate(x=2.0) as outputs:
            await outputs.__anext__()
        now = await settled(pool)
        assert [s["tensors_held"] for s in now] == [0, 0]
        assert [s["requests_held"] for s in now] == [0, 0]
        # ...and the runtime still serves.
        assert len(await collect(runtime, x=3.0)) == 2


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.parametrize("keyed", [False, True], ids=["loopback", "curve-keys"])
@pytest.mark.timeout(90)
async def test_workers_that_reach_the_pool_over_tcp_pass_tensors_over_tcp(
    tmp_path: Path, keyed: bool
) -> None:
    async with open_runtime(build_handoff()) as local:
        expected = await collect(local, x=1.5)
    # With keys the step and peer sockets listen on every interface, CURVE on each.
    keys = generate_curve_keys(tmp_path / "keys") if keyed else None
    launcher = LocalLauncher(endpoint_host="127.0.0.1", curve_keys=keys)
    async with open_runtime(build_handoff(), placement=SPLIT, launcher=launcher) as runtime:
        pool = runtime.pool
        assert pool is not None
        assert all(s.peer_endpoint.startswith("tcp://127.0.0.1:") for s in pool.ranks.values())
        before = pool.bytes_received
        answer = await collect(runtime, x=1.5)
        assert pool.bytes_received - before < H_BYTES // 8
        for got, want in zip(answer, expected, strict=True):
            assert torch.equal(got, want)
        now = await stats(pool)
        assert now[1]["tensors_fetched"] == 1
        assert [s["tensors_held"] for s in now] == [0, 0]


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_what_a_peer_sends_before_the_segment_starts_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 1's starts come late (a slow link): rank 0 makes h, sends it and says the unit that
    # made it is done, all before rank 1 has heard of the walk. Both must wait for the start.
    send = WorkerPool._send_walk_message

    async def late_to_rank_1(self: WorkerPool, rank: int, message: Any) -> None:
        if rank == 1 and isinstance(message, StartWalk):
            await anyio.sleep(0.5)
        await send(self, rank, message)

    monkeypatch.setattr(WorkerPool, "_send_walk_message", late_to_rank_1)
    async with open_runtime(build_handoff()) as local:
        expected = await collect(local, x=0.5)
    async with open_runtime(build_handoff(), placement=SPLIT) as runtime:
        assert runtime.pool is not None
        with anyio.fail_after(20):
            answer = await collect(runtime, x=0.5)
        for got, want in zip(answer, expected, strict=True):
            assert torch.equal(got, want)
