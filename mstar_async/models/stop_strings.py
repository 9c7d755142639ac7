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
        # A longer stop may have begun before a shorter one that is already whole ("aca"
        # begun at "ac" when "c" is seen): nothing is decided before that start.
        undecided = len(text) - self._partial_suffix(text)
        hit = self._first_hit(text)
        if hit is not None and hit <= undecided:
            self.stopped, self._held = True, ""
            return text[:hit]
        self._held = text[undecided:]
        return text[:undecided]

    def finish(self) -> str:
        """The text held back when the stream ends, cut before a stop it holds."""
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        hit = self._first_hit(held)
        if hit is not None:
            self.stopped = True
            return held[:hit]
        return held

    def _first_hit(self, text: str) -> int | None:
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
