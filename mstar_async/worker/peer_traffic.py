"""What the segments of walks that span ranks send each other, worker to worker.

A segment's relays (see ``mstar_async.walks.segment``) go straight to the rank that takes them,
collected per peer and sent as one ``PeerWalks`` per round, not through the conductor:

- items on a streaming edge, and its end, go to the consumer's rank; there they queue per edge,
  and each entry is pushed through the edge's policy once the previous one found room, then
  acknowledged to the producing segment as one credit (so a producer runs ahead of a slow
  consumer by its output window and the edge's bound, as within one process);
- a plain edge's final value goes to the consumer's rank once;
- a finished unit goes to every other rank of the walk.

Entries for a segment that has not started here yet wait for it (walk ids grow in the order the
conductor starts walks, so an id above every one seen is still to come); entries for one that
has ended are acknowledged at once, so its producer is not held.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mstar_async.graph import PortRef
from mstar_async.transport import PeerWalks
from mstar_async.walks.segment import DONE, END, ITEMS, VALUE


@dataclass
class _Batch:
    """What goes to one peer with the next message."""

    feeds: list[Any] = field(default_factory=list)
    credits: dict[int, int] = field(default_factory=dict)
    blocks: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.feeds or self.credits or self.blocks)


@dataclass(frozen=True)
class Route:
    """Where one segment's relays go: the walk's node -> rank, and rank -> segment id."""

    rank: int
    ranks: dict[str, int]
    peers: dict[int, int]


@dataclass
class _Inbound:
    """One streaming edge into a segment here: entries waiting, and whether one is in."""

    waiting: deque[tuple[Any, bool, int, int]] = field(default_factory=deque)
    busy: bool = False


class PeerTraffic:
    """Routes relays out and entries in for one worker; synchronous, never raises.

    ``deliver(walk_id, port, items, end, on_room)`` hands one entry to the segment (it calls
    ``on_room`` once the edge has room again; a plain edge's value or an end passes none);
    ``later(walk_id, fn)`` keeps ``fn`` for a segment still starting here and says whether it
    did; ``running(walk_id)`` says whether the segment runs here; ``wake`` asks for a send.
    """

    def __init__(
        self,
        deliver: Callable[[int, PortRef, Any, bool, Callable[[], None] | None], None],
        later: Callable[[int, Callable[[], None]], bool],
        running: Callable[[int], bool],
        wake: Callable[[], None],
    ) -> None:
        self._deliver = deliver
        self._later = later
        self._running = running
        self._wake = wake
        self.routes: dict[int, Route] = {}
        self.out: dict[int, _Batch] = defaultdict(_Batch)
        self._inbound: dict[tuple[int, str], _Inbound] = {}
        self.sent_entries = 0  # relays sent to peers
        self.taken_entries = 0  # entries from peers taken in

    # --- out --------------------------------------------------------------------------------

    def relay(self, walk_id: int, kind: str, key: str | int, value: Any) -> None:
        """Send one relay of segment ``walk_id`` where it goes."""
        route = self.routes.get(walk_id)
        if route is None:
            return
        if kind == DONE:
            for rank, peer_walk in route.peers.items():
                if rank != route.rank:
                    self.out[rank].blocks.append((peer_walk, int(key)))
        else:
            rank = route.ranks[PortRef.parse(str(key), role="edge").node]
            end = kind in (END, VALUE)
            items = value if kind in (ITEMS, VALUE) else None
            self.out[rank].feeds.append([route.peers[rank], str(key), items, end, walk_id])
        self.sent_entries += 1
        self._wake()

    def messages(self, rank: int, ready: Callable[[int], bool]) -> list[tuple[int, PeerWalks]]:
        """The ``PeerWalks`` to send now (from this worker, ``rank``), taken out of the outbox;
        a peer whose endpoint is not known yet (``ready``) keeps its batch for later."""
        out: list[tuple[int, PeerWalks]] = []
        for peer in [p for p, batch in self.out.items() if batch and ready(p)]:
            batch = self.out.pop(peer)
            out.append((peer, PeerWalks(rank, batch.feeds, batch.credits, batch.blocks)))
        return out

    def ended(self, walk_id: int) -> None:
        """Segment ``walk_id`` is over: what waits for it is acknowledged and dropped."""
        self.routes.pop(walk_id, None)
        for key in [k for k in self._inbound if k[0] == walk_id]:
            inbound = self._inbound.pop(key)
            for _, end, from_rank, from_walk in inbound.waiting:
                if not end:
                    self._credit(from_rank, from_walk)

    # --- in ----------------------------------------------------------------------------------

    def take(self, message: PeerWalks, credit: Callable[[int, int], None]) -> list[tuple[int, int]]:
        """Take in a peer's message: entries to their segments, credit to ours (through
        ``credit(walk_id, count)``); returns the finished units to apply, ``(walk id, unit)``."""
        for walk_id, port, items, end, from_walk in message.feeds:
            self.taken_entries += 1
            self._arrive(walk_id, port, items, end, message.rank, from_walk)
        for walk_id, count in message.credits.items():
            credit(walk_id, count)
        return list(message.blocks)

    def _arrive(
        self, walk_id: int, port: str, items: Any, end: bool, from_rank: int, from_walk: int
    ) -> None:
        def arrive() -> None:
            self._arrive(walk_id, port, items, end, from_rank, from_walk)

        if self._later(walk_id, arrive):
            return  # the segment is starting here: in order, once it has
        if not self._running(walk_id):
            if not end:
                self._credit(from_rank, from_walk)  # it has ended: its producer goes on
            return
        key = (walk_id, port)
        inbound = self._inbound.get(key)
        if inbound is None:
            inbound = self._inbound[key] = _Inbound()
        inbound.waiting.append((items, end, from_rank, from_walk))
        self._pump(key, inbound)

    def _pump(self, key: tuple[int, str], inbound: _Inbound) -> None:
        walk_id, port = key
        while inbound.waiting and not inbound.busy:
            items, end, from_rank, from_walk = inbound.waiting.popleft()
            ref = PortRef.parse(port, role="edge")
            if end:
                self._deliver(walk_id, ref, items, True, None)
                continue
            inbound.busy = True

            def room(from_rank: int = from_rank, from_walk: int = from_walk) -> None:
                inbound.busy = False
                self._credit(from_rank, from_walk)
                if self._inbound.get(key) is inbound:
                    self._pump(key, inbound)

            self._deliver(walk_id, ref, items, False, room)

    def _credit(self, rank: int, walk_id: int) -> None:
        credits = self.out[rank].credits
        credits[walk_id] = credits.get(walk_id, 0) + 1
        self._wake()
