"""``CancelPoints``: where a reader of an always-ready stream hears a cancel.

The request's outbox and a walk's stream hand over an item without suspending when one is
there, and park on a plain future otherwise. A cancel scope cancelled around such a reader is
delivered by anyio only while the reader waits on a future that is not yet done; a producer
that sets the reader's future in every turn of the event loop (an endless walk, a fast model)
keeps that from ever being true, and the reader runs on past its cancel. Every
``CANCEL_CHECK_EVERY`` items the reader asks anyio whether its scope was cancelled, and if so
yields, which is where the cancel lands. Counting is a plain call (no coroutine per item):
``if points.due(): await checkpoint_if_cancelled()``.
"""

from __future__ import annotations

#: Items a reader may take between two looks at its cancel scope (a look costs about a
#: microsecond when nothing was cancelled).
CANCEL_CHECK_EVERY = 32


class CancelPoints:
    """One reader's count of items taken since it last looked at its cancel scope."""

    __slots__ = ("_taken",)

    def __init__(self) -> None:
        self._taken = 0

    def due(self) -> bool:
        """Count one item; True once every ``CANCEL_CHECK_EVERY`` items, when the reader is to
        ``await anyio.lowlevel.checkpoint_if_cancelled()``. Never raises."""
        self._taken += 1
        if self._taken < CANCEL_CHECK_EVERY:
            return False
        self._taken = 0
        return True
