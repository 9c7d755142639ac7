"""Property: an edge delivers exactly the chunks its policy makes, whatever the timing.

A producer pushes random batches (lists or tensors) through a random policy into an edge with a
random bound, while a consumer with a random pace takes chunks and, at random moments, cancels
the producer's current ``send``. The consumer must get exactly what a fresh copy of the policy
produces for the same pushes, in order, each chunk once, then ``EndOfStream``.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mstar_async.policies import Chunk, ChunkPolicy, FixedChunkPolicy, SlidingWindowChunkPolicy
from mstar_async.streams import open_edge

policies = st.one_of(
    st.integers(min_value=1, max_value=5).map(FixedChunkPolicy),
    st.integers(min_value=1, max_value=6).flatmap(
        lambda window: st.integers(min_value=1, max_value=window).map(
            lambda stride: SlidingWindowChunkPolicy(window, stride)
        )
    ),
)


def make_pushes(sizes: list[int], as_tensor: bool) -> list[Any]:
    pushes: list[Any] = []
    start = 0
    for n in sizes:
        if as_tensor:
            pushes.append(torch.arange(start, start + n, dtype=torch.int64).repeat(2, 1).T)
        else:
            pushes.append(list(range(start, start + n)))
        start += n
    return pushes


@pytest.mark.anyio
@settings(
    max_examples=50,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the repository
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # anyio_backend is a constant
)
@given(
    template=policies,
    max_buffer=st.integers(min_value=0, max_value=3),
    sizes=st.lists(st.integers(min_value=0, max_value=7), max_size=25),
    as_tensor=st.booleans(),
    pace=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=8),
    cancels=st.lists(st.booleans(), min_size=1, max_size=6),  # per consumer step, cycled
)
async def test_consumer_gets_exactly_the_policys_chunks(
    template: ChunkPolicy,
    max_buffer: int,
    sizes: list[int],
    as_tensor: bool,
    pace: list[int],
    cancels: list[bool],
) -> None:
    with anyio.fail_after(10):
        pushes = make_pushes(sizes, as_tensor)
        expected: list[Chunk] = []
        reference = template.fresh()
        for items in pushes:
            expected.extend(reference.push(items))
        expected.extend(reference.close())

        tx, rx = open_edge(template.fresh(), max_buffer, name="prop")
        received: list[Chunk] = []
        current: list[anyio.CancelScope] = []  # the producer's scope around its send, if any
        cancelled = 0

        async def consumer() -> None:
            nonlocal cancelled
            step = 0
            while True:
                for _ in range(pace[step % len(pace)]):
                    await anyio.lowlevel.checkpoint()
                if cancels[step % len(cancels)] and current:
                    current[0].cancel()
                    cancelled += 1
                stats = rx.statistics()
                assert stats.buffered <= max_buffer
                try:
                    received.append(await rx.receive())
                except anyio.EndOfStream:
                    return
                step += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for items in pushes:
                with anyio.CancelScope() as scope:
                    current.append(scope)
                    try:
                        await tx.send(items)  # cancelled or not, the items are accepted
                    finally:
                        current.clear()
                if not scope.cancelled_caught:
                    assert tx.statistics().pending == 0
            await tx.aclose()

        rx.close()
        event(f"sends cancelled: {min(cancelled, 3)}{'+' if cancelled > 3 else ''}")
        assert received == expected  # in order, each once (Chunk equality covers tensors)
        assert rx.statistics().peak <= max_buffer
