"""Stop strings over streamed text: emit what cannot be part of a stop, hold back the rest."""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Cuts a stream of text deltas at the first occurrence of any stop string.

    Text that might be the start of a stop string is held back until the next delta decides
    it; the stop string itself is never emitted. Pure and synchronous.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        if any(not stop for stop in self.stops):
            raise ValueError("stop strings must be non-empty")
        self.stopped = False
        self._held = ""

    def push(self, delta: str) -> str:
        """Add ``delta``; return the text now safe to emit (none once a stop was seen)."""
        if self.stopped:
            return ""
        text = self._held + delta
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        """The text held back when the stream ends without a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
