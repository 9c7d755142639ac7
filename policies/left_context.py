"""``LeftContextChunkPolicy``: fixed-size new chunks, each preceded by earlier items as context.

Used where a decoder needs to see some already-decoded input to stay continuous across chunk
boundaries (e.g. Qwen3-Omni code2wav: 25 new codes with 25 codes of left context).
"""

from __future__ import annotations

from .policy import ChunkPolicy, Span, check_int


class LeftContextChunkPolicy(ChunkPolicy):
    """Chunk ``i``: new items ``[i*chunk, (i+1)*chunk)`` after up to ``left_context`` older ones.

    Its context is ``min(left_context, i*chunk)``; it is emitted as soon as its new items are
    complete. ``close()`` delivers the undelivered tail the same way (preceded by up to
    ``left_context`` earlier items) as one final chunk, or returns ``[]`` if nothing is
    undelivered. Retains fewer than ``chunk + left_context`` items between pushes. Pure,
    synchronous. The constructor raises ``ValueError`` unless ``chunk`` is an int >= 1 and
    ``left_context`` an int >= 0; ``push``/``close`` raise ``PolicyError`` as in ``ChunkPolicy``.
    """

    __slots__ = ("_chunk", "_left", "_next")

    def __init__(self, chunk: int, left_context: int) -> None:
        super().__init__()
        owner = "LeftContextChunkPolicy"
        self._chunk = check_int(owner, "chunk", chunk, 1)
        self._left = check_int(owner, "left_context", left_context, 0)
        self._next = 0  # stream index of the first undelivered item

    @property
    def chunk(self) -> int:
        """New items per chunk."""
        return self._chunk

    @property
    def left_context(self) -> int:
        """Most earlier items shown before a chunk's new items."""
        return self._left

    @property
    def params(self) -> dict[str, int]:
        return {"chunk": self._chunk, "left_context": self._left}

    def _ready(self, n: int) -> list[Span]:
        chunk, left, new = self._chunk, self._left, self._next
        spans: list[Span] = []
        while new + chunk <= n:
            start = max(0, new - left)
            spans.append((start, new + chunk, new - start))
            new += chunk
        self._next = new
        return spans

    def _tail(self, n: int) -> Span | None:
        new = self._next
        if new >= n:
            return None
        start = max(0, new - self._left)
        return (start, n, new - start)

    def _keep_from(self, n: int) -> int:
        return max(0, self._next - self._left)
