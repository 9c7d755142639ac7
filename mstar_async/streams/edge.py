"""Streaming edges: a chunk policy feeding a bounded channel of chunks, with backpressure.

``open_edge(policy, max_buffer)`` returns an ``(EdgeSender, EdgeReceiver)`` pair. The producer
calls ``await sender.send(items)`` with a list, or a tensor whose dim 0 is the item axis; the
items go through ``policy.push`` and every chunk it returns goes into a channel that holds at
most ``max_buffer`` chunks, so ``send`` waits while the consumer is behind (backpressure; memory
stays bounded however long the stream). ``await sender.aclose()`` flushes ``policy.close()`` and
closes the channel; the consumer's ``async for chunk in receiver`` then ends.

One producer per edge: an ``EdgeSender`` has no ``clone()``, and a second ``send``/``aclose``
while one is waiting raises ``ChannelError``. ``close_now()`` is the one call that may come from
another task (aborting a request).

Cancellation never loses or duplicates a chunk (under anyio cancellation; see
``mstar_async.streams.channel`` for native asyncio cancellation). The policy has already taken
the items when ``send`` first waits, and chunks not yet in the channel wait in the sender's
pending queue (``statistics().pending``); the next ``send``/``aclose`` delivers them first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeAlias, final

from anyio import BrokenResourceError, ClosedResourceError

from mstar_async.errors import ChannelError

from .channel import ChannelReceiver, ChannelSender, check_max_buffer, open_labelled
from .statistics import ChannelStatistics, EdgeStatistics

if TYPE_CHECKING:
    import torch

    from mstar_async.policies import Chunk, ChunkPolicy

__all__ = ["EdgeReceiver", "EdgeSender", "open_edge"]

Items: TypeAlias = "list[Any] | torch.Tensor"
"""What one ``send`` carries: a list of items, or a tensor whose dim 0 is the item axis."""


def open_edge(
    policy: ChunkPolicy, max_buffer: int, *, name: str = ""
) -> tuple[EdgeSender, EdgeReceiver]:
    """Open a streaming edge that cuts items with ``policy`` and buffers ``max_buffer`` chunks.

    ``policy`` is used as is and belongs to the edge from now on: pass a new one per stream
    (``template.fresh()``). ``max_buffer`` is an int >= 0 (0: each chunk waits for the
    consumer). ``name`` appears in error messages and reprs. Close both ends when done.
    Synchronous. Raises ``ValueError`` naming ``max_buffer`` if it is not an int >= 0.
    """
    check_max_buffer(f"open_edge({name!r})", max_buffer)
    label = f"edge {name!r}" if name else "unnamed edge"
    tx: ChannelSender[Chunk]
    rx: ChannelReceiver[Chunk]
    tx, rx = open_labelled(max_buffer, name, label)
    state = _EdgeState()
    return EdgeSender(policy, tx, state, label), EdgeReceiver(rx, state)


@final
class _EdgeState:
    """What the two ends of an edge share: the sender's queue of undelivered chunks.

    A deque because chunks leave from the front one at a time (O(1)) and new ones join at the
    back. It sits in its own object so the receiver's statistics can count it, and so
    ``close_now()`` can swap in an empty one: a ``send`` still draining the old queue then
    pops only from the old one.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: deque[Chunk] = deque()


def _edge_statistics(c: ChannelStatistics, pending: int) -> EdgeStatistics:
    return EdgeStatistics(
        buffered=c.buffered,
        peak=c.peak,
        max_buffer=c.max_buffer,
        open_senders=c.open_senders,
        open_receivers=c.open_receivers,
        waiting_senders=c.waiting_senders,
        waiting_receivers=c.waiting_receivers,
        pending=pending,
    )


@final
class EdgeSender:
    """The producing end of a streaming edge. Create pairs with ``open_edge``.

    As an async context manager: a normal exit awaits ``aclose()`` (flushes the tail); an exit
    by exception (cancellation included) calls ``close_now()``, so an error never waits on a
    slow consumer and the consumer sees the stream end without the tail. The constructor is
    internal.
    """

    __slots__ = ("_busy", "_chan", "_closed", "_flushed", "_label", "_policy", "_state")

    def __init__(
        self, policy: ChunkPolicy, chan: ChannelSender[Chunk], state: _EdgeState, label: str
    ) -> None:
        self._policy = policy
        self._chan = chan
        self._state = state
        self._label = label
        self._busy = False  # a send/aclose is between its first await and its return
        self._flushed = False  # policy.close() has been called
        self._closed = False

    @property
    def name(self) -> str:
        """The edge's name (``""`` if none was given)."""
        return self._chan.name

    @property
    def closed(self) -> bool:
        """True once ``aclose()`` or ``close_now()`` has been called (even if it raised)."""
        return self._closed

    async def send(self, items: Items) -> None:
        """Push ``items`` through the policy; deliver every chunk it completes, oldest first.

        Chunks left pending by an earlier cancelled ``send`` go first. Waits while the channel
        holds ``max_buffer`` chunks (backpressure). It is a checkpoint only when there is a chunk
        to deliver: a push that completes no chunk returns without yielding to the event loop.

        Raises ``anyio.ClosedResourceError`` after ``aclose()``/``close_now()`` (also when
        ``close_now()`` is called while this call waits), ``anyio.BrokenResourceError`` if the
        receiver is closed (checked first, so also when no chunk is due), ``ChannelError`` if
        another ``send``/``aclose`` on this sender is waiting, and whatever ``policy.push``
        raises (``PolicyError``: wrong item kind), in which case nothing was accepted.

        Cancel-safe (under anyio cancellation, see the module docstring): the policy takes
        ``items`` before the first await, so a ``send`` that is cancelled has still accepted
        them; do not send them again. Chunks it could not deliver
        stay in the pending queue, in order, and the next ``send`` or ``aclose`` delivers them
        first; none is lost or sent twice.
        """
        if self._closed:
            raise ClosedResourceError(f"{self._label}: send() on a closed edge sender")
        if self._busy:
            raise self._busy_error("send")
        chan = self._chan
        if chan._core.open_receivers == 0:
            raise BrokenResourceError(
                f"{self._label}: send(): the receiver is closed; nobody will take the chunks"
            )
        chunks = self._policy.push(items)
        pending = self._state.pending
        if chunks:
            pending.extend(chunks)
        if pending:
            self._busy = True
            try:
                await self._drain(pending)
            finally:
                self._busy = False

    async def aclose(self) -> None:
        """Flush the policy's tail chunks (waiting for buffer space), then close the channel.

        Idempotent: later calls return at once. The channel is closed whatever happens (in a
        ``finally``), so the receiver always sees ``EndOfStream`` after the chunks that made it
        into the channel. Raises ``anyio.BrokenResourceError`` if the receiver is closed while
        chunks are still to deliver (they are dropped; with nothing left to deliver it returns
        quietly), ``anyio.ClosedResourceError`` if ``close_now()`` interrupts it,
        ``ChannelError`` if a ``send`` on this sender is waiting (then nothing is closed), and
        whatever ``policy.close()`` raises.

        Cancellation: a cancelled ``aclose`` still closes the channel; the chunks it had not
        delivered yet are dropped, and the receiver sees ``EndOfStream`` after the rest.
        """
        if self._closed:
            return
        if self._busy:
            raise self._busy_error("aclose")
        self._busy = True
        try:
            if not self._flushed:
                self._flushed = True
                tail = self._policy.close()
                if tail:
                    self._state.pending.extend(tail)
            pending = self._state.pending
            if pending:
                await self._drain(pending)
        finally:
            self._busy = False
            self.close_now()

    def close_now(self) -> None:
        """Close the channel at once without flushing; drop pending chunks and the policy's tail.

        For aborting a stream (cancelling a request): may be called from any task, also while
        another task waits in ``send``/``aclose`` (that call then raises
        ``ClosedResourceError``; the chunk it was offering is withdrawn, not delivered). The
        receiver gets the chunks already in the channel, then ``EndOfStream``. Idempotent,
        synchronous, never raises.
        """
        if not self._closed:
            self._closed = True
            self._state.pending = deque()
            self._chan.close()

    def statistics(self) -> EdgeStatistics:
        """Channel statistics (in chunks) plus ``pending``. Synchronous; works after close."""
        return _edge_statistics(self._chan.statistics(), len(self._state.pending))

    async def _drain(self, pending: deque[Chunk]) -> None:
        # Each chunk leaves the queue only after the channel took it; a cancelled channel send
        # took nothing (anyio's guarantee), so the chunk stays at the head for the next call.
        send = self._chan.send
        while pending:
            await send(pending[0])
            pending.popleft()

    def _busy_error(self, call: str) -> ChannelError:
        return ChannelError(
            f"{self._label}: {call}() while another send()/aclose() on this sender is waiting; "
            "an edge has one producer: await each send before the next, or use close_now() "
            "to abort from another task"
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.aclose()
        else:
            self.close_now()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<EdgeSender of {self._label}, {self._policy!r}, {state}>"


@final
class EdgeReceiver:
    """The consuming end of a streaming edge. Create pairs with ``open_edge``.

    ``async for chunk in receiver`` yields the policy's chunks in order and ends after the
    sender's ``aclose()``/``close_now()`` once the buffer is drained. As an async context
    manager it closes on exit. The constructor is internal.
    """

    __slots__ = ("_chan", "_state")

    def __init__(self, chan: ChannelReceiver[Chunk], state: _EdgeState) -> None:
        self._chan = chan
        self._state = state

    @property
    def name(self) -> str:
        """The edge's name (``""`` if none was given)."""
        return self._chan.name

    @property
    def closed(self) -> bool:
        """True once this receiver has been closed."""
        return self._chan.closed

    async def receive(self) -> Chunk:
        """The next chunk, waiting while there is none and the sender is open.

        Always a checkpoint. Raises ``anyio.EndOfStream`` once the sender is closed and the
        buffer is empty, ``anyio.ClosedResourceError`` if this receiver is closed. Cancel-safe
        under anyio cancellation: if cancelled, no chunk was taken.
        """
        return await self._chan.receive()

    def receive_nowait(self) -> Chunk:
        """The next chunk if one is ready. Synchronous; raises as ``receive`` or ``WouldBlock``."""
        return self._chan.receive_nowait()

    def close(self) -> None:
        """Close the receiver: buffered chunks are dropped, and the sender's next ``send`` (or a
        waiting one) raises ``BrokenResourceError``. Idempotent, synchronous, never raises."""
        self._chan.close()

    async def aclose(self) -> None:
        """``close()`` as a coroutine (not a checkpoint); idempotent, never raises."""
        self._chan.close()

    def statistics(self) -> EdgeStatistics:
        """Channel statistics (in chunks) plus the sender's ``pending``. Works after close."""
        return _edge_statistics(self._chan.statistics(), len(self._state.pending))

    def __aiter__(self) -> AsyncIterator[Chunk]:
        # The channel receiver is its own iterator: iterating an edge costs nothing extra.
        return self._chan

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self._chan.close()

    def __repr__(self) -> str:
        state = "closed" if self._chan.closed else "open"
        return f"<EdgeReceiver of {self._chan._core.label}, {state}>"
