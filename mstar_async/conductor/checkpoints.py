"""``CancelPoints``: where a reader of an always-ready stream hears a cancel.

The request's outbox and a walk's stream hand over an item without suspending when one is
there, and park on a plain future otherwise. A cancel scope cancelled around such a reader is
delivered by anyio only while the reader waits on a future that is not yet done; a producer
that sets the reader's future in every turn of the event loop (an endless walk, a fast model)
keeps that from ever being true, and the reader runs on past its cancel. Every
``CANCEL_CHECK_EVERY`` items the reader asks anyio whether its scope was cancelled, and if so
yields, which is where the cancel lands.
"""

from __future__ import annotations

from anyio.lowlevel import checkpoint_if_cancelled

#: Items a reader may take between two looks at its cancel scope (a look costs about a
#: microsecond when nothing was cancelled).
CANCEL_CHECK_EVERY = 32


class CancelPoints:
    """One reader's count of items taken since it last looked at its cancel scope."""

    __slots__ = ("_taken",)

    def __init__(self) -> None:
        self._taken = 0

    async def tick(self) -> None:
        """Count one item; every ``CANCEL_CHECK_EVERY`` items, raise the reader's pending
        cancellation, if any. Raises only that cancellation; cancel-safe (takes nothing)."""
        self._taken += 1
        if self._taken >= CANCEL_CHECK_EVERY:
            self._taken = 0
            await checkpoint_if_cancelled()
