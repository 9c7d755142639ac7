"""The noop model: its loop runs K iterations and hands back what its engine computed."""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest

from mstar_async.engines import Step
from mstar_async.models import build_model
from mstar_async.models.noop import NoopEngine
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def run_one(runtime: Runtime, iterations: int) -> list[Any]:
    async with runtime.generate(iterations=iterations) as outputs:
        return [item async for item in outputs]


def test_engine_adds_one_and_stamps_its_forward() -> None:
    engine = NoopEngine()
    steps = [Step("a", "count", {"x": (0, 0, 0)}), Step("b", "count", {"x": (6, 1, 2)})]
    first = engine.forward(steps)
    second = engine.forward(steps[:1])
    assert first == [{"x": (1, engine.pid, 1)}, {"x": (7, engine.pid, 1)}]
    assert second == [{"x": (1, engine.pid, 2)}]
    assert engine.forwards == 2
    with pytest.raises(ValueError, match="forward_ms"):
        build_model("noop", forward_ms=-1.0)


async def test_in_process_runs_k_iterations() -> None:
    async with open_runtime(build_model("noop")) as runtime:
        outputs = await run_one(runtime, 7)
        counters = [n for n, _, _ in outputs]
        assert counters == list(range(1, 8))
        assert {pid for _, pid, _ in outputs} == {os.getpid()}
        # One request: one step per forward, numbered 1..7, as the batching loop counted, and
        # an eighth that ran the step launched ahead of the loop's stop (dropped).
        assert [forward for _, _, forward in outputs] == list(range(1, 8))
        assert runtime.batching.stats.forwards == 8


async def test_concurrent_requests_batch_and_count_alone() -> None:
    async with open_runtime(build_model("noop", forward_ms=1.0)) as runtime:
        results: dict[int, list[Any]] = {}

        async def one(index: int, iterations: int) -> None:
            results[index] = await run_one(runtime, iterations)

        async with anyio.create_task_group() as tg:
            for index, iterations in enumerate((3, 5, 8)):
                tg.start_soon(one, index, iterations)
        forwards = runtime.batching.stats.forwards
    for index, iterations in enumerate((3, 5, 8)):
        assert [n for n, _, _ in results[index]] == list(range(1, iterations + 1))
    stamps = {forward for outputs in results.values() for _, _, forward in outputs}
    # Every forward stamped an output but the last, which ran only the step launched ahead of
    # the longest loop's stop (a shorter loop's ahead step rode along with the others).
    assert max(stamps) == forwards - 1 and len(stamps) == forwards - 1
    assert 8 <= len(stamps) < 3 + 5 + 8  # the requests shared forwards


async def test_one_worker_runs_k_iterations() -> None:
    model = build_model("noop")
    assert model.source is not None and model.source.options == {"name": "noop"}
    async with open_runtime(model, placement=Placement.single()) as runtime:
        outputs = await run_one(runtime, 5)
        worker = runtime.pool.pid(0) if runtime.pool is not None else None
    assert [n for n, _, _ in outputs] == [1, 2, 3, 4, 5]
    assert {pid for _, pid, _ in outputs} == {worker}
    assert [forward for _, _, forward in outputs] == [1, 2, 3, 4, 5]
