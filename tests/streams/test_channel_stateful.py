"""Stateful test of the channel rules against a Python model, on asyncio and on uvloop.

Each machine instance owns one event loop (``asyncio.Runner``) for its whole life; every rule
runs one coroutine on it. Between rules no task is left running, so the model is exact: the
buffer's contents, how many ends of each kind are open, the high-water mark, and the list of
items received so far.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import anyio
import pytest
import uvloop
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar_async.streams import ChannelReceiver, ChannelSender, open_channel

from ._sync import settle_until

R = TypeVar("R")
PICK = st.integers(min_value=0, max_value=1_000)  # index into the list of ends, modulo its length
# Closing the last open end of a kind ends most of the interesting behaviour; do it 1 time in 4.
LAST_TOO = st.integers(min_value=0, max_value=3).map(lambda n: n == 0)
# What ends a send blocked on a full buffer / a receive blocked on an empty open channel.
AFTER_SEND_BLOCKS = ["cancel", "receive_nowait", "receive", "close_it", "break"]
AFTER_RECEIVE_BLOCKS = ["send_nowait", "send", "cancel", "end_stream", "close_it"]


class ChannelMachine(RuleBasedStateMachine):
    loop_factory: ClassVar[Callable[[], asyncio.AbstractEventLoop] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner(loop_factory=type(self).loop_factory)
        self.senders: list[ChannelSender[int]] = []
        self.receivers: list[ChannelReceiver[int]] = []
        # The model, filled in by open():
        self.max_buffer = 0
        self.model: deque[int] = deque()  # what the buffer holds, oldest first
        self.model_peak = 0
        self.next_item = 0
        self.accepted: list[int] = []  # every item the channel took, in order
        self.received: list[int] = []  # every item any receiver got, in order

    # ---- plumbing -------------------------------------------------------------------------

    def run(self, fn: Callable[[], Coroutine[Any, Any, R]]) -> R:
        async def bounded() -> R:
            with anyio.fail_after(10):
                return await fn()

        return self.runner.run(bounded())

    def open_senders(self) -> list[ChannelSender[int]]:
        return [s for s in self.senders if not s.closed]

    def open_receivers(self) -> list[ChannelReceiver[int]]:
        return [r for r in self.receivers if not r.closed]

    def new_item(self) -> int:
        self.next_item += 1
        return self.next_item

    def accept(self, item: int) -> None:
        """The channel took ``item`` into its buffer."""
        self.model.append(item)
        self.accepted.append(item)
        self.model_peak = max(self.model_peak, len(self.model))

    def expect_received(self, got: int) -> None:
        assert self.model, f"received {got} from a channel the model says is empty"
        want = self.model.popleft()
        assert got == want, f"FIFO broken: received {got}, expected {want}"
        self.received.append(got)

    # ---- rules --------------------------------------------------------------------------

    @initialize(max_buffer=st.integers(min_value=0, max_value=3))
    def open(self, max_buffer: int) -> None:
        tx: ChannelSender[int]
        rx: ChannelReceiver[int]
        tx, rx = open_channel(max_buffer, name="machine")
        self.senders.append(tx)
        self.receivers.append(rx)
        self.max_buffer = max_buffer

    @rule(i=PICK)
    def clone_sender(self, i: int) -> None:
        end = self.senders[i % len(self.senders)]
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError, match="machine"):
                end.clone()
        else:
            self.senders.append(end.clone())

    @rule(i=PICK)
    def clone_receiver(self, i: int) -> None:
        end = self.receivers[i % len(self.receivers)]
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError, match="machine"):
                end.clone()
        else:
            self.receivers.append(end.clone())

    @rule(i=PICK, use_aclose=st.booleans(), last_too=LAST_TOO)
    def close_sender(self, i: int, use_aclose: bool, last_too: bool) -> None:
        end = self.senders[i % len(self.senders)]
        if self.open_senders() == [end] and not last_too:
            return
        if use_aclose:
            self.run(end.aclose)
        else:
            end.close()
        assert end.closed

    @rule(i=PICK, use_aclose=st.booleans(), last_too=LAST_TOO)
    def close_receiver(self, i: int, use_aclose: bool, last_too: bool) -> None:
        end = self.receivers[i % len(self.receivers)]
        if self.open_receivers() == [end] and not last_too:
            return
        if use_aclose:
            self.run(end.aclose)
        else:
            end.close()
        assert end.closed

    @rule(i=PICK)
    def send_nowait(self, i: int) -> None:
        end = self.senders[i % len(self.senders)]
        item = self.new_item()
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError):
                end.send_nowait(item)
        elif not self.open_receivers():
            with pytest.raises(anyio.BrokenResourceError, match="machine"):
                end.send_nowait(item)
        elif len(self.model) < self.max_buffer:
            end.send_nowait(item)
            self.accept(item)
        else:  # full, and no receiver is waiting between rules
            with pytest.raises(anyio.WouldBlock):
                end.send_nowait(item)

    @rule(i=PICK, j=PICK, then=st.sampled_from(AFTER_SEND_BLOCKS))
    def send(self, i: int, j: int, then: str) -> None:
        """``await send``; on a full buffer it must block, and ``then`` says what ends the wait."""
        end = self.senders[i % len(self.senders)]
        item = self.new_item()
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError, match="machine"):
                self.run(lambda: end.send(item))
        elif not self.open_receivers():
            with pytest.raises(anyio.BrokenResourceError, match="machine"):
                self.run(lambda: end.send(item))
        elif len(self.model) < self.max_buffer:
            self.run(lambda: end.send(item))
            self.accept(item)
        else:
            self.send_blocks(end, j, item, then)

    def send_blocks(self, end: ChannelSender[int], j: int, item: int, then: str) -> None:
        event(f"send blocked on max_buffer={self.max_buffer}, then {then}")
        receivers = self.open_receivers()
        rx = receivers[j % len(receivers)]
        outcome: list[str] = []
        got: list[int] = []

        async def scenario() -> None:
            scope = anyio.CancelScope()

            async def sender() -> None:
                with scope:
                    try:
                        await end.send(item)
                    except anyio.ClosedResourceError:
                        outcome.append("closed")
                    except anyio.BrokenResourceError:
                        outcome.append("broken")
                    else:
                        outcome.append("sent")
                if scope.cancelled_caught:
                    outcome.append("cancelled")

            async with anyio.create_task_group() as tg:
                tg.start_soon(sender)
                await settle_until(lambda: end.statistics().waiting_senders == 1)
                assert outcome == [], "send returned although the buffer is full"
                assert end.statistics().buffered == self.max_buffer
                if then == "cancel":
                    scope.cancel()
                elif then == "receive_nowait":
                    got.append(rx.receive_nowait())
                elif then == "receive":
                    got.append(await rx.receive())
                elif then == "close_it":
                    end.close()
                else:  # every receiver goes away
                    for r in self.open_receivers():
                        r.close()

        self.run(scenario)
        if then == "cancel":
            assert outcome == ["cancelled"]
        elif then in ("receive_nowait", "receive"):
            assert outcome == ["sent"]
            # The receiver took the oldest item and the sender's item took its place: the
            # buffer stays full, so the peak does not move (with max_buffer=0 it stays 0).
            self.model.append(item)
            self.accepted.append(item)
            self.expect_received(got[0])
        elif then == "close_it":
            assert outcome == ["closed"]
        else:
            assert outcome == ["broken"]

    @rule(j=PICK)
    def receive_nowait(self, j: int) -> None:
        end = self.receivers[j % len(self.receivers)]
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError, match="machine"):
                end.receive_nowait()
        elif self.model:
            self.expect_received(end.receive_nowait())
        elif not self.open_senders():
            with pytest.raises(anyio.EndOfStream):
                end.receive_nowait()
        else:
            with pytest.raises(anyio.WouldBlock):
                end.receive_nowait()

    @rule(j=PICK, i=PICK, then=st.sampled_from(AFTER_RECEIVE_BLOCKS))
    def receive(self, j: int, i: int, then: str) -> None:
        """``await receive``; on an empty open channel it must block until ``then`` happens."""
        end = self.receivers[j % len(self.receivers)]
        if end.closed:
            with pytest.raises(anyio.ClosedResourceError, match="machine"):
                self.run(end.receive)
        elif self.model:
            self.expect_received(self.run(end.receive))
        elif not self.open_senders():
            with pytest.raises(anyio.EndOfStream):
                self.run(end.receive)
        else:
            self.receive_blocks(end, i, then)

    def receive_blocks(self, end: ChannelReceiver[int], i: int, then: str) -> None:
        event(f"receive blocked, then {then}")
        senders = self.open_senders()
        tx = senders[i % len(senders)]
        item = self.new_item()
        outcome: list[object] = []

        async def scenario() -> None:
            scope = anyio.CancelScope()

            async def receiver() -> None:
                with scope:
                    try:
                        outcome.append(await end.receive())
                    except anyio.EndOfStream:
                        outcome.append("end")
                    except anyio.ClosedResourceError:
                        outcome.append("closed")
                if scope.cancelled_caught:
                    outcome.append("cancelled")

            async with anyio.create_task_group() as tg:
                tg.start_soon(receiver)
                await settle_until(lambda: end.statistics().waiting_receivers == 1)
                assert outcome == []
                if then == "send_nowait":
                    tx.send_nowait(item)  # straight to the waiting receiver
                    assert tx.statistics().buffered == 0
                elif then == "send":
                    await tx.send(item)
                    assert tx.statistics().buffered == 0
                elif then == "cancel":
                    scope.cancel()
                elif then == "end_stream":
                    for s in self.open_senders():
                        s.close()
                else:
                    end.close()

        self.run(scenario)
        if then in ("send_nowait", "send"):
            assert outcome == [item]
            self.accepted.append(item)  # never buffered: the peak must not move
            self.received.append(item)
        elif then == "cancel":
            assert outcome == ["cancelled"]
        elif then == "end_stream":
            assert outcome == ["end"]
        else:
            assert outcome == ["closed"]

    @precondition(lambda self: not self.open_senders() and self.open_receivers())
    @rule(j=PICK)
    def drain_by_iteration(self, j: int) -> None:
        receivers = self.open_receivers()
        end = receivers[j % len(receivers)]
        event("drained by async iteration")

        async def drain() -> list[int]:
            return [item async for item in end]

        for got in self.run(drain):
            self.expect_received(got)
        assert not self.model

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def statistics_match_model(self) -> None:
        if not self.senders:
            return
        for end in (self.senders[0], self.receivers[-1]):
            stats = end.statistics()
            assert stats.buffered == len(self.model) <= self.max_buffer
            assert stats.peak == self.model_peak <= self.max_buffer
            assert stats.max_buffer == self.max_buffer
            assert stats.open_senders == len(self.open_senders())
            assert stats.open_receivers == len(self.open_receivers())
            assert stats.waiting_senders == stats.waiting_receivers == 0

    @invariant()
    def nothing_lost_or_duplicated(self) -> None:
        if not self.senders:
            return
        # FIFO across all clones: what was received, then what is buffered, is what was taken.
        assert self.received + list(self.model) == self.accepted
        assert len(set(self.accepted)) == len(self.accepted)

    def teardown(self) -> None:
        try:
            for tx in self.senders:
                tx.close()
            for rx in self.receivers:
                rx.close()
        finally:
            self.runner.close()


class AsyncioChannelMachine(ChannelMachine):
    loop_factory = None  # asyncio's default loop


class UvloopChannelMachine(ChannelMachine):
    loop_factory = uvloop.new_event_loop


_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the repository
    suppress_health_check=[HealthCheck.too_slow],
)

TestChannelMachineAsyncio = AsyncioChannelMachine.TestCase
TestChannelMachineAsyncio.settings = _SETTINGS
TestChannelMachineUvloop = UvloopChannelMachine.TestCase
TestChannelMachineUvloop.settings = _SETTINGS
