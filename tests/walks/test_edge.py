"""``StreamEdge``: chunks arrive in order, each once, the final one last; the producer is held at
the bound."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.policies import (
    Chunk,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)
from mstar_async.walks.edge import StreamEdge
from mstar_async.walks.trampoline import Condition, TaskGroup, Trampoline

policies = st.one_of(
    st.builds(FixedChunkPolicy, st.integers(1, 4)),
    st.integers(1, 3).flatmap(
        lambda stride: st.builds(
            SlidingWindowChunkPolicy, st.integers(stride, stride + 3), st.just(stride)
        )
    ),
    st.builds(LeftContextChunkPolicy, st.integers(1, 3), st.integers(0, 3), st.integers(0, 4)),
)


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(), max_size=5), max_size=15),
    policy=policies,
    bound=st.integers(1, 3),
    schedule=st.lists(st.booleans(), max_size=200),
)
def test_every_item_arrives_once_in_order_and_the_producer_waits_at_the_bound(
    batches: list[list[int]], policy: Any, bound: int, schedule: list[bool]
) -> None:
    ends: list[BaseException | None] = []
    trampoline = Trampoline(lambda task, request: None)
    group = TaskGroup(trampoline, ends.append)
    edge = StreamEdge(trampoline, policy, bound)
    tick = Condition(trampoline)
    pushed: list[int] = []
    got: list[int] = []
    received: list[Chunk] = []

    async def producer() -> None:
        for batch in batches:
            pushed.extend(batch)
            await edge.send(batch)
        edge.close()

    async def consumer() -> None:
        while True:
            await tick  # the test decides when the consumer reads
            chunk = await edge.receive()
            if chunk is None:
                return
            received.append(chunk)
            got.extend(chunk.new)

    group.spawn(producer())
    group.spawn(consumer())
    for read in [*schedule, *[True] * 400]:
        trampoline.run_ready()
        # Held back: what the producer has pushed is at most what the consumer took, the
        # buffer, and one send's worth of chunks past it.
        assert len(edge.chunks) <= bound + 5
        assert edge.peak <= bound
        if read:
            tick.notify_all()
        if group.ended:
            break
    assert ends == [None]
    assert got == pushed == [item for batch in batches for item in batch]
    # The stream's one final chunk reaches the consumer last, even when it brings nothing new.
    assert [c.final for c in received] == [False] * (len(received) - 1) + [True]
    assert received[-1].end == len(pushed) and received[-1].lookahead == 0


def test_abandoning_releases_a_waiting_producer_and_drops_what_was_queued() -> None:
    ends: list[BaseException | None] = []
    trampoline = Trampoline(lambda task, request: None)
    group = TaskGroup(trampoline, ends.append)
    edge = StreamEdge(trampoline, FixedChunkPolicy(1), 1)
    sent: list[int] = []

    async def producer() -> None:
        for i in range(10):
            await edge.send([i])
            sent.append(i)

    group.spawn(producer())
    trampoline.run_ready()
    assert sent == [0] and len(edge.chunks) == 2  # the second send waits
    called: list[bool] = []
    edge.on_space.append(lambda: called.append(True))
    edge.abandon()
    trampoline.run_ready()
    assert sent == list(range(10)) and not edge.chunks and called == [True]
    assert ends == [None]
