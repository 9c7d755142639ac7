"""``FixedChunkPolicy``: back-to-back chunks of one size, no overlap."""

from __future__ import annotations

from .policy import ChunkPolicy, Span, check_int


class FixedChunkPolicy(ChunkPolicy):
    """Cuts the stream into non-overlapping chunks of exactly ``size`` items, context 0.

    A chunk is emitted by the push that completes it; ``close()`` returns the remainder (fewer
    than ``size`` items) as the final chunk, or a final chunk with no items if there is none.
    Retains fewer than ``size`` items between pushes. Pure, synchronous. The constructor raises
    ``ValueError`` unless ``size`` is an int >= 1; ``push``/``close`` raise ``PolicyError`` as in
    ``ChunkPolicy``.
    """

    __slots__ = ("_next", "_size")

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = check_int("FixedChunkPolicy", "size", size, 1)
        self._next = 0  # stream index of the first undelivered item

    @property
    def size(self) -> int:
        """Items per chunk."""
        return self._size

    @property
    def params(self) -> dict[str, int]:
        return {"size": self._size}

    def _ready(self, n: int) -> list[Span]:
        size, start = self._size, self._next
        spans: list[Span] = []
        while start + size <= n:
            spans.append((start, start + size, 0, 0))
            start += size
        self._next = start
        return spans

    def _tail(self, n: int) -> list[Span]:
        return [(self._next, n, 0, 0)] if self._next < n else []

    def _keep_from(self, n: int) -> int:
        return self._next
