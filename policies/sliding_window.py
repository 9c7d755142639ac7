"""``SlidingWindowChunkPolicy``: overlapping windows at a fixed stride (e.g. Orpheus' decoder)."""

from __future__ import annotations

from .policy import ChunkPolicy, Span, check_int


class SlidingWindowChunkPolicy(ChunkPolicy):
    """Emits window ``j`` = ``stream[j*stride : j*stride + window]`` as soon as it is complete.

    The first chunk has context 0, every later one ``window - stride`` (the overlap with the
    previous window). ``close()`` returns the last ``min(window, n)`` items as the final chunk if
    any item is still undelivered, its context counting those already delivered; else a final
    chunk with no items.
    Retains at most ``window`` items. Pure, synchronous. The constructor raises ``ValueError``
    unless ``window`` is an int >= 1 and ``stride`` an int in ``[1, window]``; ``push``/``close``
    raise ``PolicyError`` as in ``ChunkPolicy``.
    """

    __slots__ = ("_delivered", "_next", "_stride", "_window")

    def __init__(self, window: int, stride: int) -> None:
        super().__init__()
        owner = "SlidingWindowChunkPolicy"
        self._window = check_int(owner, "window", window, 1)
        self._stride = check_int(owner, "stride", stride, 1, self._window, "window")
        self._next = 0  # stream index where the next window starts
        self._delivered = 0  # stream index one past the last delivered item

    @property
    def window(self) -> int:
        """Items per chunk."""
        return self._window

    @property
    def stride(self) -> int:
        """Distance between the starts of consecutive chunks."""
        return self._stride

    @property
    def params(self) -> dict[str, int]:
        return {"window": self._window, "stride": self._stride}

    def _ready(self, n: int) -> list[Span]:
        window, stride, start = self._window, self._stride, self._next
        spans: list[Span] = []
        while start + window <= n:
            # stride <= window, so the previous window reached at least this start.
            spans.append((start, start + window, self._delivered - start, 0))
            self._delivered = start + window
            start += stride
        self._next = start
        return spans

    def _tail(self, n: int) -> list[Span]:
        if self._delivered >= n:
            return []
        start = max(0, n - self._window)
        return [(start, n, self._delivered - start, 0)]

    def _keep_from(self, n: int) -> int:
        # The next window starts after n - window (it is incomplete), and close() would need
        # exactly the last `window` items, so nothing older is ever read again.
        return max(0, n - self._window)
