"""Semantics of walks run by the conductor: sequencing, parallel fan-out, loops, streams."""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import pytest
import torch

from mstar_async.conductor.conductor import OUTPUT_BUFFER
from mstar_async.errors import RequestError, WalkInputError
from mstar_async.graph import (
    DynamicLoop,
    Edge,
    Loop,
    Node,
    Parallel,
    Sequential,
    StreamEnd,
    Walk,
    stream,
)
from mstar_async.policies import Chunk, FixedChunkPolicy
from mstar_async.runtime import open_runtime
from mstar_async.walks import OUTPUT_WINDOW
from tests.conductor.helpers import make_model, t

pytestmark = pytest.mark.anyio


async def collect(runtime: Any, **inputs: Any) -> list[Any]:
    with anyio.fail_after(20):
        async with runtime.generate(**inputs) as outputs:
            return [item async for item in outputs]


def inc(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"y": x + 1}


async def test_loop_carries_values_for_a_per_request_iteration_count() -> None:
    node = Node("step", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, n: int) -> AsyncGenerator[Any, None]:
        result = await request.run("count", params={"n": n}, x=t(0))
        yield float(result["y"])

    loop = Loop("step", iterations="n", carry={"step.y": "step.x"})
    model = make_model([node], [Walk("count", loop)], program, {"inc": inc})
    async with open_runtime(model) as runtime:
        assert await collect(runtime, n=5) == [5.0]
        assert await collect(runtime, n=1) == [1.0]


async def test_nested_loops_run_inner_body_for_every_outer_iteration() -> None:
    inner = Node("inner", engine="e", op="inc", inputs=["x"], outputs=["y"])
    outer = Node("outer", engine="e", op="double", inputs=["x"], outputs=["y"])

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        yield float((await request.run("w", x=t(1)))["outer.y"])

    body = Sequential(Loop("inner", 2, carry={"inner.y": "inner.x"}), "outer")
    walk = Walk("w", Loop(body, 3, carry={"outer.y": "inner.x"}), outputs=["outer.y"])
    ops = {"inc": inc, "double": lambda x: {"y": 2 * x}}
    model = make_model([inner, outer], [walk], program, ops, [Edge("inner.y", "outer.x")])
    async with open_runtime(model) as runtime:
        # ((1+2)*2 + 2)*2 = 16, then (16 + 2) * 2 = 36
        assert await collect(runtime) == [36.0]


async def test_dynamic_loop_exits_per_request() -> None:
    node = Node("step", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, stop: float) -> AsyncGenerator[Any, None]:
        async with request.stream("w", params={"stop": stop}, x=t(0)) as events:
            async for event in events:
                yield (event.iteration, float(event.value))

    loop = DynamicLoop(
        "step",
        until=lambda s: float(s.outputs["step.y"]) >= s.params["stop"],
        max_iterations=50,
        carry={"step.y": "step.x"},
    )
    walk = Walk("w", loop, outputs=["step.y"])
    model = make_model([node], [walk], program, {"inc": inc})
    async with open_runtime(model) as runtime:
        results: dict[float, list[Any]] = {}

        async def one(stop: float) -> None:
            results[stop] = await collect(runtime, stop=stop)

        async with anyio.create_task_group() as tg:
            for stop in (3.0, 7.0, 100.0):
                tg.start_soon(one, stop)
    assert results[3.0] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert len(results[7.0]) == 7
    assert len(results[100.0]) == 50  # max_iterations caps it


async def test_parallel_branches_batch_into_one_forward() -> None:
    sizes: list[int] = []

    def eps(x: torch.Tensor, c: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes.append(len(x))
        return {"eps": x * c}

    nodes = [
        Node("cond", engine="e", op="eps", inputs=["x", "c"], outputs=["eps"]),
        Node("uncond", engine="e", op="eps", inputs=["x", "c"], outputs=["eps"]),
        Node("mix", engine="e", inputs=["a", "b"], outputs=["out"]),
    ]

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        result = await request.run("w", x=t(3), **{"cond.c": t(2), "uncond.c": t(-1)})
        yield float(result["out"])

    walk = Walk("w", Sequential(Parallel("cond", "uncond"), "mix"))
    edges = [Edge("cond.eps", "mix.a"), Edge("uncond.eps", "mix.b")]
    ops = {"eps": eps, "mix": lambda a, b: {"out": a + 10 * b}}
    model = make_model(nodes, [walk], program, ops, edges)
    async with open_runtime(model) as runtime:
        assert await collect(runtime) == [6.0 - 30.0]
    assert sizes == [2]


async def test_sequential_children_without_edges_still_run_in_order() -> None:
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str) -> Any:
        def op(x: torch.Tensor) -> dict[str, torch.Tensor]:
            with lock:
                order.append(name)
            return {"y": x}

        return op

    nodes = [Node(n, engine="e", inputs=["x"], outputs=["y"]) for n in ("a", "b", "c")]

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        await request.run("w", x=t(0))
        yield None

    walk = Walk("w", Sequential("a", "b", "c"))
    model = make_model(nodes, [walk], program, {n: record(n) for n in "abc"})
    async with open_runtime(model) as runtime:
        await collect(runtime)
    assert order == ["a", "b", "c"]


def _streaming_model(chunk: int, consumer_ops: dict[str, Any]) -> Any:
    producer = Node("gen", engine="e", op="inc", inputs=["x"], outputs=["y"])
    consumer = Node("sum", engine="e", inputs=["items"], outputs=["total"])

    async def program(request: Any, n: int) -> AsyncGenerator[Any, None]:
        async with request.stream("w", params={"n": n}, x=t(0)) as events:
            async for event in events:
                yield float(event.value)

    loop = Loop("gen", "n", carry={"gen.y": "gen.x"})
    walk = Walk("w", Sequential(loop, "sum"), outputs=["sum.total"])
    edge = stream("gen.y", "sum.items", FixedChunkPolicy(chunk), max_buffer=2)
    return make_model([producer, consumer], [walk], program, {"inc": inc, **consumer_ops}, [edge])


async def test_streaming_edge_fires_the_consumer_once_per_chunk() -> None:
    def total(items: list[Chunk]) -> dict[str, Any]:
        return {"total": [float(c.data.sum()) for c in items]}

    model = _streaming_model(3, {"sum": total})
    async with open_runtime(model) as runtime:
        # items 1..10 in chunks of 3: [1,2,3] [4,5,6] [7,8,9] [10]
        assert await collect(runtime, n=10) == [6.0, 15.0, 24.0, 10.0]


async def test_first_chunk_arrives_while_the_producer_loop_still_runs() -> None:
    produced: list[int] = []

    def counting_inc(x: torch.Tensor) -> dict[str, torch.Tensor]:
        produced.append(len(x))
        return {"y": x + 1}

    def total(items: list[Chunk]) -> dict[str, Any]:
        return {"total": [float(c.data.sum()) for c in items]}

    model = _streaming_model(2, {"sum": total, "inc": counting_inc})
    async with open_runtime(model) as runtime:
        with anyio.fail_after(20):
            async with runtime.generate(n=200) as outputs:
                first = await outputs.__anext__()
                steps_at_first_output = len(produced)
                rest = [item async for item in outputs]
    assert first == 3.0
    # The producer can be ahead by what the buffers hold, 2 items per output: the walk's output
    # window, the request's output buffer, the output the program holds while that buffer is
    # full, the edge's 2 chunks and the chunk being made; far from the whole loop's 200 steps.
    assert steps_at_first_output <= 2 * (OUTPUT_WINDOW + OUTPUT_BUFFER + 1 + 2 + 1) + 1
    # 99 more chunks of two, then the stream's final chunk, with no items: 200 ends on a boundary.
    assert len(rest) == 100 and rest[-1] == 0.0


async def test_loop_consuming_a_stream_ends_with_the_stream() -> None:
    producer = Node("gen", engine="e", op="inc", inputs=["x"], outputs=["y"])
    acc = Node("acc", engine="e", inputs=["chunk", "total"], outputs=["total"])

    def accumulate(chunk: list[Chunk], total: torch.Tensor) -> dict[str, Any]:
        return {"total": total + torch.stack([c.data.sum() for c in chunk])}

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        result = await request.run("w", params={"n": 9}, x=t(0), total=t(0))
        yield float(result["acc.total"])

    body = DynamicLoop(
        "acc", until=lambda s: False, max_iterations=100, carry={"acc.total": "acc.total"}
    )
    walk = Walk(
        "w", Sequential(Loop("gen", "n", carry={"gen.y": "gen.x"}), body), outputs=["acc.total"]
    )
    edge = stream("gen.y", "acc.chunk", FixedChunkPolicy(4))
    model = make_model([producer, acc], [walk], program, {"inc": inc, "acc": accumulate}, [edge])
    async with open_runtime(model) as runtime:
        assert await collect(runtime) == [45.0]


def _seen(chunk: list[Chunk | StreamEnd]) -> dict[str, Any]:
    # Per firing: the new items' sum (+100 on the final chunk), or -1 once the stream has ended.
    return {
        "seen": [
            -1.0 if isinstance(c, StreamEnd) else float(sum(c.new)) + 100.0 * c.final for c in chunk
        ]
    }


def _outliving_model(outlives: bool, iterations: int) -> Any:
    producer = Node("gen", engine="e", op="inc", inputs=["x"], outputs=["y"])
    reader = Node("read", engine="e", op="seen", inputs=["chunk"], outputs=["seen"])

    async def program(request: Any, n: int) -> AsyncGenerator[Any, None]:
        async with request.stream("w", params={"n": n}, x=t(0)) as events:
            async for event in events:
                yield event.iteration, event.value

    loop = DynamicLoop(
        "read",
        until=lambda s: s.iteration + 1 >= iterations,
        max_iterations=100,
        outlives_streams=outlives,
    )
    walk = Walk(
        "w", Sequential(Loop("gen", "n", carry={"gen.y": "gen.x"}), loop), outputs=["read.seen"]
    )
    edge = stream("gen.y", "read.chunk", FixedChunkPolicy(2))
    return make_model([producer, reader], [walk], program, {"inc": inc, "seen": _seen}, [edge])


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        # [1, 2] [3, 4], the final [5], then the ended stream until `until`.
        (5, [3.0, 7.0, 105.0, -1.0, -1.0, -1.0]),
        # Ending on a boundary, the final chunk brings nothing new.
        (4, [3.0, 7.0, 100.0, -1.0, -1.0, -1.0]),
    ],
)
async def test_a_loop_outliving_its_stream_sees_the_final_chunk_then_the_end(
    n: int, expected: list[float]
) -> None:
    async with open_runtime(_outliving_model(True, 6)) as runtime:
        got = await collect(runtime, n=n)
    assert got == list(enumerate(expected))


async def test_by_default_a_loop_reading_a_stream_ends_after_its_final_chunk() -> None:
    async with open_runtime(_outliving_model(False, 6)) as runtime:
        assert await collect(runtime, n=5) == [(0, 3.0), (1, 7.0), (2, 105.0)]


async def test_values_persist_across_walks_through_edges() -> None:
    a = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])
    b = Node("b", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, skip_first: bool = False) -> AsyncGenerator[Any, None]:
        if not skip_first:
            await request.run("first", x=t(10))
        yield float((await request.run("second"))["y"])

    walks = [Walk("first", "a"), Walk("second", "b")]
    model = make_model([a, b], walks, program, {"inc": inc}, [Edge("a.y", "b.x")])
    async with open_runtime(model) as runtime:
        assert await collect(runtime) == [12.0]
        with pytest.raises(RequestError) as caught:
            await collect(runtime, skip_first=True)
    assert isinstance(caught.value.__cause__, WalkInputError)
    assert "a.y feeds from another walk" in str(caught.value.__cause__)


async def test_missing_and_unknown_walk_inputs_name_the_port() -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, mode: str) -> AsyncGenerator[Any, None]:
        if mode == "missing":
            await request.run("w")
        else:
            await request.run("w", x=t(1), bogus=t(2))
        yield None

    model = make_model([node], [Walk("w", "a")], program, {"inc": inc})
    async with open_runtime(model) as runtime:
        with pytest.raises(RequestError, match=r"needs input a.x; pass x=\.\.\."):
            await collect(runtime, mode="missing")
        with pytest.raises(RequestError, match=r"takes no input 'bogus'"):
            await collect(runtime, mode="unknown")


async def test_an_engine_failure_fails_only_its_request() -> None:
    def fragile(x: torch.Tensor) -> dict[str, torch.Tensor]:
        if bool((x < 0).any()):
            raise ValueError("negative input")
        return {"y": x + 1}

    node = Node("a", engine="e", op="fragile", inputs=["x"], outputs=["y"])

    async def program(request: Any, value: float) -> AsyncGenerator[Any, None]:
        yield float((await request.run("w", x=t(value)))["y"])

    model = make_model([node], [Walk("w", "a")], program, {"fragile": fragile})
    async with open_runtime(model) as runtime:
        with pytest.raises(RequestError, match="negative input"):
            await collect(runtime, value=-1)
        assert await collect(runtime, value=1) == [2.0]


async def test_bad_request_inputs_fail_before_anything_runs() -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, value: float) -> AsyncGenerator[Any, None]:
        yield value

    model = make_model([node], [Walk("w", "a")], program, {"inc": inc})
    async with open_runtime(model) as runtime:
        with pytest.raises(RequestError, match="bad request inputs"):
            runtime.generate(nope=1)
