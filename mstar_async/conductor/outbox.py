"""``Outbox``: the bounded queue between a request's program and whoever reads its outputs.

One producer (the request task), one reader (the client). It carries every output a request
makes, so it is built for that path alone: a ``put`` with room and a ``get`` with an item
return without suspending (a general channel spends a scheduler checkpoint, an event and a
task switch on each), and a side that must wait parks on one plain future. The vocabulary is
anyio's, so callers handle it as they would a memory stream: ``EndOfStream`` once the
producer has closed and the queue is drained, ``BrokenResourceError`` to a producer whose
reader has gone, ``ClosedResourceError`` to a reader that closed its own end.

Its reader looks at its own cancel scope every few outputs (``CancelPoints``): the reader of
an endless producer that keeps ahead of it can still be cancelled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from mstar_async.conductor.checkpoints import CancelPoints


class Outbox:
    """A bounded FIFO of outputs with one producer and one reader, on one event loop.

    Raises:
        ValueError: ``max_buffer`` is below 1.
    """

    __slots__ = (
        "_cancel_points",
        "_items",
        "_max",
        "_producer_waiter",
        "_reader_waiter",
        "done",
        "reader_gone",
    )

    def __init__(self, max_buffer: int) -> None:
        if max_buffer < 1:
            raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
        self._max = max_buffer
        self._items: deque[Any] = deque()
        self.done = False  # the producer closed
        self.reader_gone = False
        self._reader_waiter: asyncio.Future[None] | None = None
        self._producer_waiter: asyncio.Future[None] | None = None
        self._cancel_points = CancelPoints()

    @property
    def buffered(self) -> int:
        """Outputs waiting for the reader."""
        return len(self._items)

    @property
    def closed(self) -> bool:
        """Whether both ends are closed (for leak checks)."""
        return self.done and self.reader_gone

    def try_put(self, item: Any) -> bool:
        """Queue ``item`` if there is room (True), without waiting; False when full, or when
        an end is closed (``put`` then raises what fits).

        Never raises."""
        if self.reader_gone or self.done or len(self._items) >= self._max:
            return False
        self._items.append(item)
        _wake(self._reader_waiter)
        return True

    async def put(self, item: Any) -> None:
        """Queue ``item``, waiting while the queue is full. Cancel-safe: a cancelled put
        queued nothing.

        Raises:
            anyio.BrokenResourceError: the reader has gone.
            anyio.ClosedResourceError: the producer already closed.
        """
        while not self.try_put(item):
            if self.reader_gone:
                raise anyio.BrokenResourceError
            if self.done:
                raise anyio.ClosedResourceError
            self._producer_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._producer_waiter
            finally:
                self._producer_waiter = None

    async def get(self) -> Any:
        """The oldest output, waiting for one. Cancel-safe: an output is taken only when
        this returns it.

        Raises:
            anyio.EndOfStream: the producer closed and every output was read.
            anyio.ClosedResourceError: this reader closed its end.
        """
        if self._cancel_points.due():
            await checkpoint_if_cancelled()
        while not self._items:
            if self.reader_gone:
                raise anyio.ClosedResourceError
            if self.done:
                raise anyio.EndOfStream
            self._reader_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._reader_waiter
            finally:
                self._reader_waiter = None
        if self.reader_gone:
            raise anyio.ClosedResourceError
        item = self._items.popleft()
        _wake(self._producer_waiter)
        return item

    def close_producer(self) -> None:
        """No more outputs; the reader gets what is queued, then ``EndOfStream``."""
        self.done = True
        _wake(self._reader_waiter)

    def close_reader(self) -> None:
        """The reader is gone: queued outputs are dropped and the producer is told."""
        self.reader_gone = True
        self._items.clear()
        _wake(self._producer_waiter)
        _wake(self._reader_waiter)

    def close(self) -> None:
        """Close both ends (the request is over)."""
        self.close_producer()
        self.close_reader()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
