"""Walk inputs that arrive as a stream while the walk runs (``Walk(streams=...)``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from mstar_async.errors import GraphError, RequestError
from mstar_async.graph import Node, Walk
from mstar_async.policies import Chunk, FixedChunkPolicy
from mstar_async.runtime import open_runtime
from tests.conductor.helpers import make_model

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def summing_model(max_buffer: int = 8, size: int = 4) -> Any:
    def total(frames: list[Chunk]) -> dict[str, Any]:
        return {"sum": [sum(chunk.new) for chunk in frames]}

    async def program(request: Any, frames: AsyncIterator[list[int]]) -> AsyncGenerator[Any, None]:
        async with request.stream("listen", frames=frames) as events:
            async for event in events:
                yield event.value

    node = Node("enc", engine="e", op="sum", inputs=["frames"], outputs=["sum"])
    walk = Walk(
        "listen", "enc", streams={"enc.frames": FixedChunkPolicy(size)}, max_buffer=max_buffer
    )
    return make_model([node], [walk], program, {"sum": total})


async def frames(count: int, read: list[int]) -> AsyncGenerator[list[int], None]:
    for i in range(count):
        read.append(i)
        yield [i]


async def test_a_streamed_input_fires_its_node_once_per_chunk_as_items_arrive() -> None:
    read: list[int] = []
    async with open_runtime(summing_model()) as runtime:
        async with runtime.generate(frames=frames(10, read)) as outputs:
            sums = [value async for value in outputs]
    # Chunks of 4 items, the rest in the final chunk when the stream ends.
    assert sums == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9]
    assert read == list(range(10))


async def test_a_fast_source_is_held_back_by_a_reader_that_does_not_read() -> None:
    read: list[int] = []
    async with open_runtime(summing_model(max_buffer=1, size=1)) as runtime:
        async with runtime.generate(frames=frames(10_000, read)) as outputs:
            await outputs.__anext__()
            for _ in range(50):  # give the feeder every chance to run ahead
                await anyio.lowlevel.checkpoint()
            # The walk's output window (16), the request's buffer (16), one chunk in the input
            # buffer, one in the node and one in the feed: nothing near the whole source.
            assert len(read) < 60
        assert len(read) < 60  # leaving stops the feed too


async def test_a_missing_or_plain_streamed_input_is_refused_with_the_fix() -> None:
    async with open_runtime(summing_model()) as runtime:
        with pytest.raises(RequestError, match="async iterable"):
            async with runtime.generate(frames=[1, 2, 3]) as outputs:
                [x async for x in outputs]


def test_a_stream_must_name_a_free_input_outside_loops() -> None:
    node = Node("enc", engine="e", op="sum", inputs=["frames"], outputs=["sum"])
    with pytest.raises(GraphError, match="not a free input port"):
        make_model(
            [node],
            [Walk("w", "enc", streams={"enc.nope": FixedChunkPolicy(2)})],
            _never,
            {},
        )


async def _never(request: Any) -> AsyncGenerator[Any, None]:
    if False:
        yield None
