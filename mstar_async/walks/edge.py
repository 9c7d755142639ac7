"""``StreamEdge``: a streaming edge between two nodes of one walk, on the walk's trampoline.

One producer and one consumer, both coroutines of the same walk; nothing here blocks a thread
or touches the event loop. The invariant the property tests check: the consumer receives the
policy's chunks, in order, each once, and never more than ``max_buffer`` of them wait for it
while the producer is held back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from mstar_async.policies import Chunk, ChunkPolicy
from mstar_async.walks.trampoline import Condition, Trampoline


class StreamEdge:
    """A streaming edge inside one walk: the policy's chunks in a deque for the consumer.

    ``send`` pushes items through the policy and waits while more than ``max_buffer`` chunks
    wait for the consumer (the chunk past the bound waits at the producer: that is the
    backpressure); ``receive`` waits while none does and returns ``None`` once the edge is
    closed and drained. ``abandon`` (the consumer is gone) drops what is queued and releases
    the producer for good. Feeders from outside the walk (a streamed walk input) register
    ``on_space`` callbacks instead of waiting.
    """

    __slots__ = (
        "chunks",
        "closed",
        "cond",
        "max_buffer",
        "on_space",
        "peak",
        "policy",
        "reader_gone",
    )

    def __init__(self, trampoline: Trampoline, policy: ChunkPolicy, max_buffer: int) -> None:
        self.policy = policy
        self.max_buffer = max_buffer
        self.chunks: deque[Chunk] = deque()
        self.cond = Condition(trampoline)
        self.closed = False
        self.reader_gone = False
        self.on_space: list[Callable[[], None]] = []  # feeders from outside, waiting for room
        self.peak = 0  # most chunks held for the consumer at once (a producer's extra waits)

    @property
    def full(self) -> bool:
        return len(self.chunks) > self.max_buffer and not self.reader_gone

    def space(self) -> None:
        """Tell outside feeders waiting for room that there is some (or that nobody reads)."""
        if self.on_space and not self.full:
            waiting, self.on_space = self.on_space, []
            for callback in waiting:
                callback()

    async def send(self, items: Any) -> None:
        self._put(self.policy.push(items))
        while len(self.chunks) > self.max_buffer and not self.reader_gone:
            await self.cond

    def close(self) -> None:
        if not self.closed:
            self._put(self.policy.close())
            self.closed = True
            self.cond.notify_all()

    def _put(self, chunks: list[Chunk]) -> None:
        if chunks and not self.reader_gone:
            self.chunks.extend(chunks)
            self.peak = max(self.peak, min(len(self.chunks), self.max_buffer))
            self.cond.notify_all()

    async def receive(self) -> Chunk | None:
        """The next chunk, or ``None`` once the stream has ended and drained."""
        while not self.chunks:
            if self.closed:
                return None
            await self.cond
        self.cond.notify_all()
        chunk = self.chunks.popleft()
        self.space()
        return chunk

    def abandon(self) -> None:
        self.reader_gone = True
        self.chunks.clear()
        self.cond.notify_all()
        self.space()
