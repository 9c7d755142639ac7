"""Channels: anyio memory-stream semantics, names in errors, statistics, cancellation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import anyio
import pytest

from mstar_async.streams import ChannelReceiver, ChannelSender, ChannelStatistics, open_channel
from mstar_async.streams.channel import _buffer_len_getter

from ._sync import settle_until


def ints(max_buffer: int, name: str = "test") -> tuple[ChannelSender[int], ChannelReceiver[int]]:
    return open_channel(max_buffer, name=name)


# ---- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, 2.0, "4", None, True, math.inf])
def test_bad_max_buffer_is_a_value_error_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_buffer"):
        open_channel(bad)


def test_names_and_repr() -> None:
    tx, rx = ints(2, name="tokens")
    with tx, rx:
        assert tx.name == rx.name == "tokens"
        assert "tokens" in repr(tx) and "open" in repr(rx)
    assert "closed" in repr(tx)
    tx2: ChannelSender[str]
    rx2: ChannelReceiver[str]
    tx2, rx2 = open_channel(1)
    with tx2, rx2:
        assert tx2.name == "" and "unnamed channel" in repr(tx2)


# ---- the anyio rules ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_fifo_then_end_of_stream_forever() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(3)
        async with tx, rx:
            for i in range(3):
                await tx.send(i)
            with pytest.raises(anyio.WouldBlock):
                tx.send_nowait(99)
            tx.close()
            assert [i async for i in rx] == [0, 1, 2]
            for _ in range(2):
                with pytest.raises(anyio.EndOfStream):
                    await rx.receive()
                with pytest.raises(anyio.EndOfStream):
                    rx.receive_nowait()


def test_end_of_stream_only_after_every_sender_clone_closed() -> None:
    tx, rx = ints(2)
    tx2 = tx.clone()
    tx.close()
    with pytest.raises(anyio.WouldBlock):
        rx.receive_nowait()
    tx2.send_nowait(7)
    tx2.close()
    assert rx.receive_nowait() == 7
    with pytest.raises(anyio.EndOfStream):
        rx.receive_nowait()
    rx.close()


@pytest.mark.anyio
async def test_end_of_stream_wakes_a_waiting_receiver() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(1)
        result: list[str] = []

        async def consume() -> None:
            async for _ in rx:
                result.append("item")
            result.append("end")

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await settle_until(lambda: rx.statistics().waiting_receivers == 1)
            tx.close()
        assert result == ["end"]
        rx.close()


@pytest.mark.anyio
async def test_broken_only_when_every_receiver_clone_closed() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(2, name="audio")
        rx2 = rx.clone()
        rx.close()
        await tx.send(1)
        assert rx2.receive_nowait() == 1
        rx2.close()
        with pytest.raises(anyio.BrokenResourceError, match="audio"):
            await tx.send(2)
        with pytest.raises(anyio.BrokenResourceError, match="audio"):
            tx.send_nowait(2)
        tx.close()


@pytest.mark.anyio
async def test_every_call_on_a_closed_end_is_closed_resource_error() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(2, name="text")
        keep_tx, keep_rx = tx.clone(), rx.clone()  # the channel itself stays usable
        await tx.aclose()
        await rx.aclose()
        assert tx.closed and rx.closed and not keep_tx.closed and not keep_rx.closed
        for call in (lambda: tx.send_nowait(1), tx.clone, rx.receive_nowait, rx.clone):
            with pytest.raises(anyio.ClosedResourceError, match="text"):
                call()
        with pytest.raises(anyio.ClosedResourceError, match="text"):
            await tx.send(1)
        with pytest.raises(anyio.ClosedResourceError, match="text"):
            await rx.receive()
        with pytest.raises(anyio.ClosedResourceError, match="text"):
            await rx.__anext__()
        tx.close()  # idempotent
        await rx.aclose()
        keep_tx.send_nowait(5)
        assert keep_rx.receive_nowait() == 5
        keep_tx.close()
        keep_rx.close()


@pytest.mark.anyio
async def test_zero_buffer_is_a_rendezvous() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(0)
        got: list[int] = []
        async with tx, rx:
            with pytest.raises(anyio.WouldBlock):
                tx.send_nowait(1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(tx.send, 1)
                await settle_until(lambda: tx.statistics().waiting_senders == 1)
                got.append(rx.receive_nowait())
            assert got == [1]
            assert tx.statistics().peak == 0


@pytest.mark.anyio
async def test_closing_the_sender_withdraws_its_blocked_send() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(1, name="x")
        tx.send_nowait(1)
        errors: list[BaseException] = []

        async def blocked_send() -> None:
            try:
                await tx.send(2)
            except anyio.ClosedResourceError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_send)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            tx.close()
        assert len(errors) == 1 and "x" in str(errors[0])
        assert [i async for i in rx] == [1]  # 2 was withdrawn, not delivered
        rx.close()


@pytest.mark.anyio
async def test_closing_every_receiver_breaks_a_blocked_send() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(1)
        tx.send_nowait(1)
        errors: list[BaseException] = []

        async def blocked_send() -> None:
            try:
                await tx.send(2)
            except anyio.BrokenResourceError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_send)
            await settle_until(lambda: tx.statistics().waiting_senders == 1)
            rx.close()
        assert len(errors) == 1
        tx.close()


def test_sync_context_managers_close() -> None:
    tx, rx = ints(1)
    with tx as t, rx as r:
        assert t is tx and r is rx
    assert tx.closed and rx.closed


# ---- statistics -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_statistics_snapshot() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(4)
        tx2 = tx.clone()
        await tx.send(1)
        await tx2.send(2)
        stats = rx.statistics()
        assert stats == ChannelStatistics(
            buffered=2,
            peak=2,
            max_buffer=4,
            open_senders=2,
            open_receivers=1,
            waiting_senders=0,
            waiting_receivers=0,
        )
        assert tx.statistics() == stats
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.peak = 0  # type: ignore[misc]
        for c in (tx, tx2, rx):
            c.close()
        assert tx.statistics().open_senders == 0  # still readable after close


@pytest.mark.anyio
async def test_peak_is_the_high_water_mark() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(4)
        async with tx, rx:
            for i in range(3):
                tx.send_nowait(i)
            rx.receive_nowait()
            rx.receive_nowait()
            await tx.send(3)
            stats = tx.statistics()
            assert (stats.buffered, stats.peak) == (2, 3)
            for i in range(2):
                tx.send_nowait(i)
            assert tx.statistics().peak == 4
            while rx.statistics().buffered:
                rx.receive_nowait()
            assert tx.statistics().peak == 4


@pytest.mark.anyio
async def test_items_handed_to_a_waiting_receiver_do_not_raise_the_peak() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(4)
        got: list[int] = []

        async def consume() -> None:
            async for item in rx:
                got.append(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(50):
                await settle_until(lambda: rx.statistics().waiting_receivers == 1)
                if i % 2:
                    await tx.send(i)
                else:
                    tx.send_nowait(i)
                assert tx.statistics().buffered == 0
            tx.close()
        assert got == list(range(50))
        assert rx.statistics().peak == 0
        rx.close()


def test_buffer_length_falls_back_to_public_statistics() -> None:
    """If a future anyio moves its buffer, the peak is still exact (just slower)."""

    class Opaque:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def statistics(self) -> Any:
            return self.inner.statistics()

    send, receive = anyio.create_memory_object_stream[int](3)
    with send, receive:
        fast, slow = _buffer_len_getter(send), _buffer_len_getter(Opaque(send))  # type: ignore[arg-type]
        send.send_nowait(1)
        send.send_nowait(2)
        assert fast() == slow() == 2


# ---- cancellation ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_blocked_send_delivers_nothing() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(1)
        async with tx, rx:
            tx.send_nowait(1)
            with anyio.move_on_after(0) as scope:
                await tx.send(2)
            assert scope.cancelled_caught
            async with anyio.create_task_group() as tg:
                scope2 = anyio.CancelScope()

                async def blocked_send() -> None:
                    with scope2:
                        await tx.send(3)

                tg.start_soon(blocked_send)
                await settle_until(lambda: tx.statistics().waiting_senders == 1)
                scope2.cancel()
            assert scope2.cancelled_caught
            assert tx.statistics().waiting_senders == 0
            assert rx.receive_nowait() == 1
            await tx.send(4)
            tx.close()
            assert [i async for i in rx] == [4]  # neither 2 nor 3 was delivered


@pytest.mark.anyio
async def test_cancelled_blocked_receive_takes_nothing() -> None:
    with anyio.fail_after(10):
        tx, rx = ints(2)
        async with tx, rx:
            scope = anyio.CancelScope()

            async def blocked_receive() -> None:
                with scope:
                    await rx.receive()
                    pytest.fail("received from an empty channel")

            async with anyio.create_task_group() as tg:
                tg.start_soon(blocked_receive)
                await settle_until(lambda: rx.statistics().waiting_receivers == 1)
                scope.cancel()
            tx.send_nowait(1)
            assert rx.receive_nowait() == 1


@pytest.mark.anyio
async def test_cancel_right_after_a_handoff_still_delivers_the_item() -> None:
    """The item handed to a waiting receiver is never dropped by a cancel that arrives late."""
    with anyio.fail_after(10):
        tx, rx = ints(1)
        got: list[int] = []
        async with tx, rx:
            scope = anyio.CancelScope()

            async def receiver() -> None:
                with scope:
                    got.append(await rx.receive())

            async with anyio.create_task_group() as tg:
                tg.start_soon(receiver)
                await settle_until(lambda: rx.statistics().waiting_receivers == 1)
                tx.send_nowait(1)  # handed over...
                scope.cancel()  # ...then cancelled before the receiver ran
            if not got:  # if the cancel won, the item must still be in the channel
                got.append(rx.receive_nowait())
            assert got == [1]


@pytest.mark.anyio
async def test_cancel_right_after_the_receiver_took_a_blocked_sends_item() -> None:
    """A send whose item was taken is not reported as cancelled (no duplicate on retry)."""
    with anyio.fail_after(10):
        tx, rx = ints(0)
        outcome: list[str] = []
        async with tx, rx:
            scope = anyio.CancelScope()

            async def sender() -> None:
                with scope:
                    await tx.send(1)
                    outcome.append("sent")
                if scope.cancelled_caught:
                    outcome.append("cancelled")

            async with anyio.create_task_group() as tg:
                tg.start_soon(sender)
                await settle_until(lambda: tx.statistics().waiting_senders == 1)
                assert rx.receive_nowait() == 1  # taken...
                scope.cancel()  # ...then cancelled before the sender ran
            assert outcome[0] == "sent"
