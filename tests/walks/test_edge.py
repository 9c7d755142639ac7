"""``StreamEdge``: chunks arrive in order, each once, the final one last; the producer is held at
the bound."""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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


class EdgeMachine(RuleBasedStateMachine):
    """A producer and a consumer on one ``StreamEdge``, each move chosen by hypothesis: the
    consumer's new items are always a prefix of what was sent, in order, the producer is held
    at the bound, and the stream ends with its one final chunk, last."""

    @initialize(policy=policies, bound=st.integers(1, 3))
    def start(self, policy: Any, bound: int) -> None:
        self.trampoline = Trampoline(lambda task, request: None)
        self.ends: list[BaseException | None] = []
        self.group = TaskGroup(self.trampoline, self.ends.append)
        self.edge = StreamEdge(self.trampoline, policy, bound)
        self.bound = bound
        self.batches: deque[list[int]] = deque()
        self.sent: list[int] = []
        self.got: list[int] = []
        self.received: list[Chunk] = []
        self.closing = False
        self.reads = 0
        self.drained = False
        self.wake = Condition(self.trampoline)
        self.read_one = Condition(self.trampoline)
        self.group.spawn(self._producer())
        self.group.spawn(self._consumer())
        self.trampoline.run_ready()

    async def _producer(self) -> None:
        while True:
            while not self.batches and not self.closing:
                await self.wake
            if not self.batches:
                self.edge.close()
                return
            batch = self.batches.popleft()
            self.sent.extend(batch)
            await self.edge.send(batch)

    async def _consumer(self) -> None:
        while True:
            while not self.reads:
                await self.read_one
            self.reads -= 1
            chunk = await self.edge.receive()
            if chunk is None:
                self.drained = True
                return
            self.received.append(chunk)
            self.got.extend(chunk.new)

    @precondition(lambda self: not self.closing)
    @rule(batch=st.lists(st.integers(), max_size=5))
    def send(self, batch: list[int]) -> None:
        self.batches.append(batch)
        self.wake.notify_all()
        self.trampoline.run_ready()

    @rule()
    def read(self) -> None:
        self.reads += 1
        self.read_one.notify_all()
        self.trampoline.run_ready()

    @precondition(lambda self: not self.closing)
    @rule()
    def close(self) -> None:
        self.closing = True
        self.wake.notify_all()
        self.trampoline.run_ready()

    @invariant()
    def new_items_are_a_prefix_of_what_was_sent(self) -> None:
        assert self.got == self.sent[: len(self.got)]

    @invariant()
    def the_producer_is_held_at_the_bound(self) -> None:
        # Past the bound only one send's chunks (at most 5 items, so 5 chunks) may wait.
        assert self.edge.peak <= self.bound
        assert len(self.edge.chunks) <= self.bound + 5

    @invariant()
    def only_the_last_chunk_received_may_be_final(self) -> None:
        assert not any(c.final for c in self.received[:-1])
        if self.drained:
            assert self.received[-1].final

    def teardown(self) -> None:
        if not hasattr(self, "edge"):
            return
        if not self.closing:
            self.close()
        while not self.drained:
            self.read()
        assert self.got == self.sent
        assert [c.final for c in self.received].count(True) == 1 and self.received[-1].final
        assert self.ends == [None]


EdgeMachine.TestCase.settings = settings(max_examples=150, deadline=None, database=None)
test_edge_machine = EdgeMachine.TestCase
