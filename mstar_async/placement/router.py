"""``ReplicaRouter``: which replica of an engine serves a request.

Pure bookkeeping, no I/O: the conductor asks it once per (request, engine) and tells it when a
request ends. A request sticks to the replica it got for an engine, because the engine may
hold state for it there (a KV cache lives on one replica); a new request goes to the least
loaded replica, ties to the lowest rank, so routing is reproducible. A request meant for one
replica in particular is ``pin``ned to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple


class Route(NamedTuple):
    """Where a request's steps of one engine go: ``rank``. ``moved_from`` is the rank that held
    the request's state for that engine when it must move there first (a migration between
    walks), else ``None``."""

    rank: int
    moved_from: int | None = None


class ReplicaRouter:
    """Routes requests to replicas: least loaded first, sticky per (request, engine).

    A rank's load is the number of unfinished requests routed to it for at least one engine.
    """

    def __init__(self) -> None:
        self._assigned: dict[str, dict[str, int]] = {}  # request -> engine -> rank
        self._loads: dict[int, int] = {}

    @property
    def loads(self) -> dict[int, int]:
        """Unfinished requests per rank (ranks with none left out); a copy."""
        return dict(self._loads)

    def rank_of(self, request_id: str, engine: str) -> int | None:
        """The rank that serves ``request_id``'s steps of ``engine``, if it has one."""
        return self._assigned.get(request_id, {}).get(engine)

    def route(
        self,
        request_id: str,
        engine: str,
        ranks: Sequence[int],
        loads: Mapping[int, int] | None = None,
    ) -> Route:
        """The rank among ``ranks`` (the engine's replicas in the current walk) that serves
        ``request_id``'s steps of ``engine``.

        A request keeps the rank it already has for the engine while that rank is among
        ``ranks``. Otherwise it gets the least loaded of ``ranks`` (lowest rank on a tie) and,
        if it had a rank before, ``Route.moved_from`` names it: the caller moves the request's
        state from there. ``loads`` gives in-flight counts to compare instead of this router's
        own (a rank missing from it counts 0).

        Raises:
            ValueError: ``ranks`` is empty.
        """
        if not ranks:
            raise ValueError(f"route: engine {engine!r} has no ranks to route request to")
        held = self._assigned.setdefault(request_id, {})
        current = held.get(engine)
        if current is not None and current in ranks:
            return Route(current)
        counts = self._loads if loads is None else loads
        pick = min(ranks, key=lambda rank: (counts.get(rank, 0), rank))
        before = set(held.values())
        held[engine] = pick
        self._recount(before, set(held.values()))
        return Route(pick, current)

    def pin(self, request_id: str, engine: str, rank: int) -> None:
        """Route ``request_id``'s steps of ``engine`` to ``rank`` from now on, whatever the
        loads (it counts on ``rank``'s load until ``finish``): for a request meant for one
        replica in particular, such as each run of a walk sent to every replica. Pin a rank
        among the engine's replicas in the walks the request runs, before it runs any.

        Raises:
            ValueError: the request already has another rank for ``engine``.
        """
        held = self._assigned.setdefault(request_id, {})
        current = held.get(engine)
        if current is not None and current != rank:
            raise ValueError(
                f"pin: request {request_id!r} already runs engine {engine!r} on rank {current}"
            )
        before = set(held.values())
        held[engine] = rank
        self._recount(before, set(held.values()))

    def finish(self, request_id: str) -> None:
        """Forget ``request_id``: its ranks each carry one request less. Idempotent."""
        held = self._assigned.pop(request_id, None)
        if held:
            self._recount(set(held.values()), set())

    def _recount(self, before: set[int], after: set[int]) -> None:
        # A request counts once per rank however many of its engines live there.
        for rank in before - after:
            self._loads[rank] -= 1
            if not self._loads[rank]:
                del self._loads[rank]
        for rank in after - before:
            self._loads[rank] = self._loads.get(rank, 0) + 1
