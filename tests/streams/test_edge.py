"""Streaming edges: chunking, backpressure, cancellation, closing, misuse."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from mstar_async.errors import ChannelError, PolicyError
from mstar_async.policies import Chunk, ChunkPolicy, FixedChunkPolicy, SlidingWindowChunkPolicy
from mstar_async.streams import (
    ChannelStatistics,
    EdgeReceiver,
    EdgeStatistics,
    open_edge,
)

from ._sync import settle_until


def expected_chunks(template: ChunkPolicy, pushes: list[Any]) -> list[Chunk]:
    """What a fresh copy of ``template`` produces for ``pushes`` then ``close()``."""
    policy = template.fresh()
    out: list[Chunk] = []
    for items in pushes:
        out.extend(policy.push(items))
    out.extend(policy.close())
    return out


async def collect(rx: EdgeReceiver) -> list[Chunk]:
    return [chunk async for chunk in rx]


# ---- the basics -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_list_items_become_the_policys_chunks_then_end_of_stream() -> None:
    with anyio.fail_after(10):
        template = FixedChunkPolicy(3)
        pushes = [[0, 1], [2, 3, 4, 5, 6], [], [7]]
        tx, rx = open_edge(template.fresh(), 8, name="tokens")
        for items in pushes:
            await tx.send(items)
        await tx.aclose()
        got = await collect(rx)
        assert got == expected_chunks(template, pushes)
        assert [c.data for c in got] == [[0, 1, 2], [3, 4, 5], [6, 7]]
        assert got[-1].final and not got[0].final
        with pytest.raises(anyio.EndOfStream):
            await rx.receive()
        rx.close()


@pytest.mark.anyio
async def test_tensor_items_with_a_sliding_window() -> None:
    with anyio.fail_after(10):
        template = SlidingWindowChunkPolicy(4, 2)
        frames = torch.arange(22, dtype=torch.float32).reshape(11, 2)
        pushes = [frames[:3], frames[3:4], frames[4:11]]
        tx, rx = open_edge(template.fresh(), 2, name="codes")
        got: list[Chunk] = []
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                got.extend(await collect(rx))

            tg.start_soon(consume)
            async with tx:
                for items in pushes:
                    await tx.send(items)
        assert got == expected_chunks(template, pushes)
        assert all(isinstance(c.data, torch.Tensor) and c.data.shape[1:] == (2,) for c in got)
        assert [(c.start, c.context) for c in got] == [(0, 0), (2, 2), (4, 2), (6, 2), (7, 3)]
        rx.close()


@pytest.mark.anyio
async def test_zero_buffer_edge_hands_each_chunk_over() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 0)
        got: list[Chunk] = []
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                got.extend(await collect(rx))

            tg.start_soon(consume)
            await tx.send([1, 2, 3])
            await tx.aclose()
        assert [c.data for c in got] == [[1], [2], [3]]
        assert rx.statistics().peak == 0
        rx.close()


@pytest.mark.anyio
async def test_statistics_are_channel_statistics_plus_pending() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 2, name="s")
        await tx.send([1, 2])
        stats = tx.statistics()
        assert isinstance(stats, ChannelStatistics)
        assert stats == EdgeStatistics(
            buffered=2,
            peak=2,
            max_buffer=2,
            open_senders=1,
            open_receivers=1,
            waiting_senders=0,
            waiting_receivers=0,
            pending=0,
        )
        assert rx.statistics() == stats
        assert tx.name == rx.name == "s" and "s" in repr(tx) and "s" in repr(rx)
        tx.close_now()
        rx.close()
        assert tx.closed and rx.closed


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None, False])
def test_bad_max_buffer_is_a_value_error_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_buffer"):
        open_edge(FixedChunkPolicy(2), bad)


@pytest.mark.anyio
async def test_policy_errors_propagate_and_accept_nothing() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(2), 4)
        await tx.send([1])
        with pytest.raises(PolicyError):
            await tx.send(torch.zeros(3))  # a tensor into a list stream
        await tx.send([2])
        await tx.aclose()
        assert [c.data for c in await collect(rx)] == [[1, 2]]
        rx.close()


# ---- backpressure ---------------------------------------------------------------------------


async def run_backpressure(n_items: int, per_push: int, template: ChunkPolicy) -> tuple[int, int]:
    """Fast producer, slow consumer; returns (peak buffered, most pending ever seen)."""
    tx, rx = open_edge(template.fresh(), 4, name="bp")
    pushes = [list(range(i, min(i + per_push, n_items))) for i in range(0, n_items, per_push)]
    most_chunks_per_push = max(len(c) for c in _chunks_per_push(template, pushes))
    max_pending = 0
    received: list[Chunk] = []

    async def slow_consumer() -> None:
        nonlocal max_pending
        while True:
            for _ in range(3):  # the consumer is ~3x slower than the producer
                await anyio.lowlevel.checkpoint()
            stats = rx.statistics()
            assert stats.buffered <= 4
            max_pending = max(max_pending, stats.pending)
            try:
                received.append(await rx.receive())
            except anyio.EndOfStream:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_consumer)
        for items in pushes:
            await tx.send(items)
            assert tx.statistics().pending == 0  # a send that returned delivered everything
        await tx.aclose()
    rx.close()
    assert received == expected_chunks(template, pushes)
    assert max_pending <= most_chunks_per_push
    return rx.statistics().peak, max_pending


def _chunks_per_push(template: ChunkPolicy, pushes: list[Any]) -> list[list[Chunk]]:
    policy = template.fresh()
    return [policy.push(items) for items in pushes] + [policy.close()]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("template", "per_push"),
    [(FixedChunkPolicy(1), 1), (FixedChunkPolicy(2), 10), (SlidingWindowChunkPolicy(6, 2), 7)],
    ids=["fixed1-by1", "fixed2-by10", "window6/2-by7"],
)
async def test_backpressure_bounds_memory_whatever_the_stream_length(
    template: ChunkPolicy, per_push: int
) -> None:
    with anyio.fail_after(10):
        short_peak, short_pending = await run_backpressure(500, per_push, template)
        long_peak, long_pending = await run_backpressure(5_000, per_push, template)
        assert short_peak == long_peak == 4  # the producer was always ahead: buffer full
        assert short_pending == long_pending > 0  # it did wait with chunks in hand


# ---- cancellation ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_send_keeps_its_chunks_pending_and_the_next_send_delivers_them() -> None:
    with anyio.fail_after(10):
        template = FixedChunkPolicy(1)
        tx, rx = open_edge(template.fresh(), 2, name="c")
        await tx.send([0, 1])  # the buffer is now full
        scope = anyio.CancelScope()

        async def blocked_send() -> None:
            with scope:
                await tx.send([2, 3, 4])

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_send)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            assert tx.statistics().pending == 3
            scope.cancel()
        assert scope.cancelled_caught
        assert tx.statistics().pending == 3
        assert tx.statistics().waiting_senders == 0

        # A send cancelled before it could deliver anything keeps its chunks too.
        with anyio.CancelScope() as pre_cancelled:
            pre_cancelled.cancel()
            await tx.send([5])
        assert tx.statistics().pending == 4

        got: list[Chunk] = []
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                got.extend(await collect(rx))

            tg.start_soon(consume)
            await tx.send([6])  # delivers the pending chunks first, in order
            assert tx.statistics().pending == 0
            await tx.aclose()
        assert [c.data[0] for c in got] == list(range(7))  # each exactly once, in order
        rx.close()


@pytest.mark.anyio
async def test_pending_chunks_go_first_even_when_the_next_push_completes_none() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(2), 1)
        await tx.send([0, 1])  # buffer full
        with anyio.move_on_after(0):
            await tx.send([2, 3])
        assert tx.statistics().pending == 1
        assert [c.data for c in [rx.receive_nowait()]] == [[0, 1]]
        await tx.send([4])  # completes no chunk, but delivers [2, 3]
        assert tx.statistics().pending == 0
        assert rx.receive_nowait().data == [2, 3]
        await tx.aclose()
        assert [c.data for c in await collect(rx)] == [[4]]
        rx.close()


@pytest.mark.anyio
async def test_cancelled_aclose_still_closes_the_channel() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(2), 1, name="flush")
        await tx.send([0, 1, 2])  # chunk [0, 1] fills the buffer, 2 waits in the policy
        scope = anyio.CancelScope()

        async def closer() -> None:
            with scope:
                await tx.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(closer)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            assert tx.statistics().pending == 1  # the tail chunk [2]
            scope.cancel()
        assert scope.cancelled_caught
        assert tx.closed
        stats = rx.statistics()
        assert (stats.open_senders, stats.pending) == (0, 0)
        got = await collect(rx)  # what was delivered, then EndOfStream
        assert [c.data for c in got] == [[0, 1]]
        await tx.aclose()  # idempotent
        with pytest.raises(anyio.ClosedResourceError, match="flush"):
            await tx.send([3])
        rx.close()


@pytest.mark.anyio
async def test_close_now_aborts_a_waiting_send() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 1, name="abort")
        await tx.send([0])
        errors: list[BaseException] = []

        async def producer() -> None:
            try:
                await tx.send([1, 2])
            except anyio.ClosedResourceError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            tx.close_now()
        assert len(errors) == 1
        assert tx.statistics().pending == 0
        assert [c.data for c in await collect(rx)] == [[0]]
        tx.close_now()  # idempotent
        await tx.aclose()  # a no-op once closed
        rx.close()


@pytest.mark.anyio
async def test_close_now_during_a_send_whose_chunk_was_already_taken() -> None:
    """The draining send must not trip over the emptied queue."""
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 0)
        outcome: list[str] = []

        async def producer() -> None:
            try:
                await tx.send([1, 2])
            except anyio.ClosedResourceError:
                outcome.append("closed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            assert rx.receive_nowait().data == [1]  # taken; the producer has not resumed yet
            tx.close_now()
        assert outcome == ["closed"]  # chunk [2] was never offered
        with pytest.raises(anyio.EndOfStream):
            rx.receive_nowait()
        rx.close()


# ---- the receiver going away ----------------------------------------------------------------


@pytest.mark.anyio
async def test_send_after_the_receiver_closed_is_broken() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(4), 2, name="gone")
        await rx.aclose()
        with pytest.raises(anyio.BrokenResourceError, match="gone"):
            await tx.send([1])  # even though this push completes no chunk
        await tx.aclose()  # nothing to deliver: closes quietly
        assert tx.closed


@pytest.mark.anyio
async def test_a_waiting_send_breaks_when_the_receiver_closes() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 1)
        await tx.send([0])
        errors: list[BaseException] = []

        async def producer() -> None:
            try:
                await tx.send([1])
            except anyio.BrokenResourceError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            rx.close()
        assert len(errors) == 1
        with pytest.raises(anyio.BrokenResourceError):
            await tx.aclose()  # the tail can not be delivered...
        assert tx.closed  # ...but the sender is closed all the same


# ---- the producer contract ------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_sends_are_a_channel_error() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(1), 1, name="one-producer")
        await tx.send([0])
        async with anyio.create_task_group() as tg:
            tg.start_soon(tx.send, [1])
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            with pytest.raises(ChannelError, match="one-producer"):
                await tx.send([2])
            with pytest.raises(ChannelError):
                await tx.aclose()
            assert rx.receive_nowait().data == [0]
        await tx.aclose()
        assert [c.data for c in await collect(rx)] == [[1]]  # [2] was never accepted
        rx.close()


@pytest.mark.anyio
async def test_async_with_flushes_on_success_and_aborts_on_error() -> None:
    with anyio.fail_after(10):
        tx, rx = open_edge(FixedChunkPolicy(2), 4)
        async with tx:
            await tx.send([1, 2, 3])
        assert [c.data for c in await collect(rx)] == [[1, 2], [3]]
        rx.close()

        tx, rx = open_edge(FixedChunkPolicy(2), 4)
        with pytest.raises(RuntimeError):
            async with tx:
                await tx.send([1, 2, 3])
                raise RuntimeError("producer failed")
        assert tx.closed
        assert [c.data for c in await collect(rx)] == [[1, 2]]  # no tail after a failure
        async with rx:
            pass
        assert rx.closed
