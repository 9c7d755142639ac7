"""``request.run_on_replicas``: a walk run once on every replica of its engines, each run a
request of its own pinned to its replica and released however it ends (success, a failure on
one replica, a cancel); in process, or with nothing replicated, it is ``run``.

The ranks here are batching loops in this process behind the same ``PlacedExecutor`` that
fronts worker processes, so routing, pinning and release are the runtime's own."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from mstar_async.conductor import Conductor
from mstar_async.conductor.dispatch import PlacedExecutor
from mstar_async.conductor.walk_stream import WalkControl, WalkInbox
from mstar_async.engines import StatelessEngine
from mstar_async.errors import RequestError
from mstar_async.graph import Model, Node, PortRef, Walk
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.worker.walk_loop import WalkLoop
from tests.conductor.helpers import t

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _program(request: Any, x: float = 0.0) -> AsyncGenerator[Any, None]:
    results = await request.run_on_replicas("mark", x=t(x))
    yield [float(r["y"]) for r in results]


def _model() -> Model:
    return Model(
        "replicas",
        nodes=[Node("mark", engine="e", inputs=["x"], outputs=["y"])],
        walks=[Walk("mark", "mark", outputs=["mark.y"])],
        program=_program,
        components={"e": lambda: StatelessEngine({"mark": lambda x: {"y": x}})},
    )


class Ranks:
    """A ``RankExecutor`` over one batching loop per rank in this process, recording every
    release; rank ``r``'s engine adds ``100 * r`` to its input."""

    def __init__(self, model: Model, ops: Mapping[int, Callable[[Any], dict[str, Any]]]) -> None:
        self.model = model
        self.loops = {
            rank: WalkLoop({"e": StatelessEngine({"mark": op})}) for rank, op in ops.items()
        }
        self.released: list[tuple[int, str]] = []

    async def release_on(self, rank: int, request_id: str) -> None:
        self.released.append((rank, request_id))
        await self.loops[rank].release(request_id)

    def open_walk_on(
        self,
        rank: int,
        request_id: str,
        walk: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
        *,
        moves: Mapping[str, int] | None = None,
    ) -> WalkControl:
        assert not moves, "a request stays on its replica"
        plan = self.model.plan(walk)
        return self.loops[rank].open_walk(request_id, plan, inputs, params, persisted, sink)

    def open_segments(self, *args: Any) -> WalkControl:
        raise AssertionError("a one-node walk runs on one rank")


def _marking(rank: int) -> Callable[[Any], dict[str, Any]]:
    return lambda x: {"y": x + 100 * rank}


@asynccontextmanager
async def _placed(ranks: Ranks) -> AsyncIterator[tuple[Conductor, PlacedExecutor]]:
    placement = Placement(nodes={"mark": list(ranks.loops)}).validate(ranks.model)
    executor = PlacedExecutor(placement, ranks)
    async with anyio.create_task_group() as tg:
        for loop in ranks.loops.values():
            await tg.start(loop.run)
        async with Conductor(ranks.model, executor, walks=executor) as conductor:
            yield conductor, executor
        tg.cancel_scope.cancel()


async def _one(conductor: Conductor, **inputs: Any) -> list[Any]:
    with anyio.fail_after(10):
        async with conductor.generate(request_id="r", **inputs) as out:
            return [item async for item in out]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_every_replica_runs_the_walk_once_and_each_run_is_released() -> None:
    ranks = Ranks(_model(), {rank: _marking(rank) for rank in range(3)})
    async with _placed(ranks) as (conductor, executor):
        assert await _one(conductor, x=5.0) == [[5.0, 105.0, 205.0]]  # by replica number
        assert sorted(ranks.released) == [(0, "r@0"), (1, "r@1"), (2, "r@2")]
        assert executor.router.loads == {}
        assert all(loop.walks_running == 0 for loop in ranks.loops.values())


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failure_on_one_replica_lets_the_others_finish_then_fails_the_request() -> None:
    ran: list[int] = []

    def failing(x: Any) -> dict[str, Any]:
        raise ValueError("rank 0 cannot")

    def marking(x: Any) -> dict[str, Any]:
        ran.append(1)
        return {"y": x + 100}

    ranks = Ranks(_model(), {0: failing, 1: marking})
    async with _placed(ranks) as (conductor, executor):
        with pytest.raises(RequestError, match="rank 0 cannot"):
            await _one(conductor, x=5.0)
        assert ran == [1]
        assert sorted(ranks.released) == [(0, "r@0"), (1, "r@1")]
        assert executor.router.loads == {}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cancelled_mid_run_every_replica_request_is_released() -> None:
    entered, gate = threading.Event(), threading.Event()

    def blocking(x: Any) -> dict[str, Any]:
        entered.set()
        gate.wait(10)
        return {"y": x + 100}

    ranks = Ranks(_model(), {0: _marking(0), 1: blocking})
    async with _placed(ranks) as (conductor, executor):
        stream = conductor.generate(request_id="r", x=5.0)
        deadline = time.monotonic() + 10
        while not entered.is_set():  # rank 1's step is in its forward
            assert time.monotonic() < deadline
            await anyio.sleep(0.005)
        stream.cancel()
        gate.set()
        with anyio.fail_after(10):
            await stream.aclose()
        assert stream.cancelled
        assert sorted(ranks.released) == [(0, "r@0"), (1, "r@1")]
        assert executor.router.loads == {}
        assert all(loop.walks_running == 0 for loop in ranks.loops.values())


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_in_process_it_is_one_run() -> None:
    async with open_runtime(_model()) as runtime:
        with anyio.fail_after(10):
            async with runtime.generate(x=2.0) as out:
                assert [item async for item in out] == [[2.0]]
