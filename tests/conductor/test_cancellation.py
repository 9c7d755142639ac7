"""Cancelling a request stops its walks, closes its channels and generators, and leaks no task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from mstar_async.errors import RequestCancelled
from mstar_async.graph import DynamicLoop, Node, Sequential, Walk, stream
from mstar_async.policies import Chunk, FixedChunkPolicy
from mstar_async.runtime import Runtime, open_runtime
from tests.conductor.helpers import make_model, t

pytestmark = pytest.mark.anyio


class Probe:
    """Records what the program saw and whether its generator was finalised."""

    def __init__(self) -> None:
        self.finalised = False
        self.released: list[str] = []


def endless_model(probe: Probe) -> Any:
    gen = Node("gen", engine="e", op="inc", inputs=["x"], outputs=["y"])
    sink = Node("sink", engine="e", inputs=["items"], outputs=["out"])

    def sink_op(items: list[Chunk]) -> dict[str, Any]:
        return {"out": [c.data.clone() for c in items]}

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        try:
            async with request.stream("w", x=t(0)) as events:
                async for event in events:
                    yield event.value
        finally:
            probe.finalised = True

    loop = DynamicLoop("gen", until=lambda s: False, max_iterations=10**9, carry={"gen.y": "gen.x"})
    walk = Walk("w", Sequential(loop, "sink"), outputs=["sink.out"])
    ops = {"inc": lambda x: {"y": x + 1}, "sink": sink_op}
    edges = [stream("gen.y", "sink.items", FixedChunkPolicy(2), max_buffer=2)]
    return make_model([gen, sink], [walk], program, ops, edges)


async def _settled_tasks() -> set[asyncio.Task[Any]]:
    await wait_all_tasks_blocked()
    return set(asyncio.all_tasks())


def _watch_release(runtime: Runtime, probe: Probe) -> None:
    original = runtime.batching.release

    async def release(request_id: str) -> None:
        probe.released.append(request_id)
        await original(request_id)

    runtime.batching.release = release  # type: ignore[method-assign]


def _assert_all_closed(stream: Any, probe: Probe, runtime: Runtime) -> None:
    assert stream.context is not None
    channels = stream.context.channels
    assert len(channels) >= 1  # the request's output
    assert all(end.closed for end in channels)
    assert stream.context.walk_streams and all(walk.ended for walk in stream.context.walk_streams)
    assert runtime.batching.walks_running == 0
    assert probe.finalised
    assert probe.released == [stream.request_id]
    assert runtime.conductor.active == {}


async def test_aclose_mid_stream_leaves_nothing_alive() -> None:
    probe = Probe()
    with anyio.fail_after(20):
        async with open_runtime(endless_model(probe)) as runtime:
            _watch_release(runtime, probe)
            baseline = await _settled_tasks()
            outputs = runtime.generate()
            first = await outputs.__anext__()
            assert torch.equal(first, torch.tensor([1.0, 2.0]))
            await outputs.aclose()
            assert outputs.cancelled
            _assert_all_closed(outputs, probe, runtime)
            assert await _settled_tasks() == baseline


async def test_cancelling_the_consumer_task_cancels_the_request() -> None:
    probe = Probe()
    with anyio.fail_after(20):
        async with open_runtime(endless_model(probe)) as runtime:
            _watch_release(runtime, probe)
            baseline = await _settled_tasks()
            received = 0
            async with runtime.generate() as outputs:
                with anyio.CancelScope() as scope:
                    async for _ in outputs:
                        received += 1
                        if received == 3:
                            scope.cancel()
            assert scope.cancelled_caught
            _assert_all_closed(outputs, probe, runtime)
            assert await _settled_tasks() == baseline


async def test_cancel_from_elsewhere_raises_request_cancelled_to_the_reader() -> None:
    probe = Probe()
    with anyio.fail_after(20):
        async with open_runtime(endless_model(probe)) as runtime:
            async with runtime.generate() as outputs:
                await outputs.__anext__()
                outputs.cancel()
                with pytest.raises(RequestCancelled):
                    async for _ in outputs:
                        pass
            assert probe.finalised


async def test_many_requests_cancelled_at_once_leak_nothing() -> None:
    probe = Probe()
    with anyio.fail_after(30):
        async with open_runtime(endless_model(probe)) as runtime:
            baseline = await _settled_tasks()
            streams = [runtime.generate() for _ in range(8)]
            for s in streams:
                await s.__anext__()
            assert runtime.batching.stats.max_batch > 1
            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(s.aclose)
            for s in streams:
                assert s.context is not None
                assert all(end.closed for end in s.context.channels)
            assert runtime.conductor.active == {}
            assert await _settled_tasks() == baseline


async def test_closing_the_runtime_cancels_requests_still_running() -> None:
    probe = Probe()
    with anyio.fail_after(20):
        async with open_runtime(endless_model(probe)) as runtime:
            outputs = runtime.generate()
            await outputs.__anext__()
        assert outputs.cancelled
        assert probe.finalised
