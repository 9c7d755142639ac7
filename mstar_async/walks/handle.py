"""``RunningWalk``: the handle a host in this process gives the conductor for one ``WalkRun``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mstar_async.graph import PortRef
from mstar_async.walks.run import WalkRun


class RunningWalk:
    """Controls a ``WalkRun`` on this event loop (a ``WalkControl``): every call changes the
    run, then ``kick`` wakes whatever drives its trampoline; ``on_cancel`` runs after a cancel
    (to stop the walk's steps in flight, where they run elsewhere)."""

    __slots__ = ("kick", "on_cancel", "run")

    def __init__(
        self,
        run: WalkRun,
        kick: Callable[[], None],
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.kick = kick
        self.on_cancel = on_cancel

    def ack(self, count: int) -> None:
        """The reader took ``count`` outputs: credit back to the walk."""
        self.run.ack(count)
        self.kick()

    def cancel(self) -> None:
        """Stop the walk now (its sink hears ``end`` before this returns)."""
        self.run.cancel()
        if self.on_cancel is not None:
            self.on_cancel()
        self.kick()

    async def feed(self, port: PortRef, items: Any) -> None:
        """Items of the streamed input ``port``; returns once it has room for more (or the walk
        has ended). Cancel-safe: the items were taken either way.

        Raises:
            KeyError: ``port`` is not a streamed input of the walk.
        """
        feeding = self.run.feed_async(port, items)
        self.kick()
        await feeding

    def end_input(self, port: PortRef) -> None:
        """The streamed input ``port`` has ended."""
        self.run.end_input(port)
        self.kick()
