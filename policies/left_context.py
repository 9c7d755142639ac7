"""``LeftContextChunkPolicy``: fixed-size new chunks between earlier and later items as context.

Used where a decoder needs to see already-decoded input to stay continuous across chunk
boundaries (Qwen3-Omni code2wav: 25 new codes after 25 codes of left context), and, with
``lookahead``, where its output for an item also depends on the items after it (SNAC's
non-causal convolutions in Orpheus: one new frame between one frame before and two after).
"""

from __future__ import annotations

from .policy import ChunkPolicy, Span, check_int


class LeftContextChunkPolicy(ChunkPolicy):
    """Chunk ``i``: new items ``[i*chunk, (i+1)*chunk)`` after up to ``left_context`` older ones
    and before ``lookahead`` later ones.

    Its context is ``min(left_context, i*chunk)`` and its look-ahead ``lookahead``; it is
    emitted as soon as its look-ahead is complete, so a chunk waits for ``lookahead`` items
    past its new ones. ``close()`` delivers the undelivered tail on the same grid of ``chunk``
    new items, each with its left context and whatever look-ahead the stream still has (the
    last one, partial if the stream ends off the grid, has none and is final); with nothing
    undelivered it returns a final chunk with no items. Retains fewer than
    ``chunk + left_context + lookahead`` items between pushes. Pure, synchronous. The
    constructor raises ``ValueError`` unless ``chunk`` is an int >= 1 and ``left_context`` and
    ``lookahead`` ints >= 0; ``push``/``close`` raise ``PolicyError`` as in ``ChunkPolicy``.
    """

    __slots__ = ("_chunk", "_left", "_lookahead", "_next")

    def __init__(self, chunk: int, left_context: int, lookahead: int = 0) -> None:
        super().__init__()
        owner = "LeftContextChunkPolicy"
        self._chunk = check_int(owner, "chunk", chunk, 1)
        self._left = check_int(owner, "left_context", left_context, 0)
        self._lookahead = check_int(owner, "lookahead", lookahead, 0)
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
    def lookahead(self) -> int:
        """Later items shown after a chunk's new items (fewer only at the end of the stream)."""
        return self._lookahead

    @property
    def params(self) -> dict[str, int]:
        return {"chunk": self._chunk, "left_context": self._left, "lookahead": self._lookahead}

    def _span(self, new: int, stop_new: int, stop: int) -> Span:
        start = max(0, new - self._left)
        return (start, stop, new - start, stop - stop_new)

    def _ready(self, n: int) -> list[Span]:
        chunk, ahead, new = self._chunk, self._lookahead, self._next
        spans: list[Span] = []
        while new + chunk + ahead <= n:
            spans.append(self._span(new, new + chunk, new + chunk + ahead))
            new += chunk
        self._next = new
        return spans

    def _tail(self, n: int) -> list[Span]:
        spans: list[Span] = []
        new = self._next
        while new < n:
            stop_new = min(new + self._chunk, n)
            spans.append(self._span(new, stop_new, min(stop_new + self._lookahead, n)))
            new = stop_new
        return spans

    def _keep_from(self, n: int) -> int:
        return max(0, self._next - self._left)
