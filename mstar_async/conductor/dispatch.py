"""Running each walk of a request on the workers that placement names for its nodes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from mstar_async.errors import PlacementError
from mstar_async.graph import PortRef, WalkPlan
from mstar_async.graph.segments import WalkSplit, split_walk
from mstar_async.placement import ReplicaRouter, ResolvedPlacement

if TYPE_CHECKING:
    from mstar_async.conductor.walk_stream import WalkControl, WalkInbox


class RankExecutor(Protocol):
    """Runs walks on numbered ranks (worker processes)."""

    async def release_on(self, rank: int, request_id: str) -> None:
        """Tell ``rank`` that ``request_id`` is over; never raises."""
        ...

    def open_walk_on(
        self,
        rank: int,
        request_id: str,
        walk: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
        *,
        moves: Mapping[str, int] | None = None,
    ) -> WalkControl:
        """Run walk ``walk`` on ``rank``'s worker, which first takes the request's state of
        each engine in ``moves`` from the rank named there; outputs and end go to ``sink``.
        Never raises."""
        ...

    def open_segments(
        self,
        request_id: str,
        split: WalkSplit,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
        moves: Mapping[int, Mapping[str, int]] | None = None,
    ) -> WalkControl:
        """Run a walk whose nodes span ranks as one segment per rank (``moves`` per rank as
        for ``open_walk_on``); outputs and end go to ``sink``. Never raises."""
        ...


class PlacedExecutor:
    """A ``WalkHost`` that runs each walk where placement puts its nodes: on the one worker
    that holds them all, or as one segment per rank (every loop of a walk is on one rank:
    ``Placement.validate`` refuses others).

    A node placed on several ranks is a replica set: a request goes to the least loaded
    replica and stays there (its state lives on one rank), unless ``pin_replica`` sends it to
    one in particular (``RequestContext.run_on_replicas``). A request whose state in an engine
    lives on another rank than the one its next walk uses there (prefill on rank 0, decode on
    rank 1) has it moved worker to worker as that walk starts (see
    ``mstar_async.worker.state_moves``); the conductor only names the move.
    """

    def __init__(self, placement: ResolvedPlacement, ranks: RankExecutor) -> None:
        self.placement = placement
        self.ranks = ranks
        self.router = ReplicaRouter()
        self._touched: dict[str, set[int]] = defaultdict(set)
        self._homes: dict[tuple[str, str], int] = {}  # (request, engine) -> rank holding state
        self._splits: dict[tuple[str, tuple[tuple[str, int], ...]], WalkSplit | None] = {}

    def replica_count(self, plan: WalkPlan) -> int:
        """The most replicas any engine of ``plan`` has in that walk (1: none replicated)."""
        ranks = self.placement.engine_ranks[plan.walk.name].values()
        return max((len(r) for r in ranks), default=1)

    def pin_replica(self, request_id: str, plan: WalkPlan, replica: int) -> None:
        """Send ``request_id``'s steps of each replicated engine of ``plan`` to that engine's
        replica number ``replica`` (modulo its count: with N replicas, ``replica`` 0..N-1 reach
        each once) until ``release(request_id)``. Call it before the request runs anything.

        Raises:
            ValueError: the request already runs one of those engines on another replica.
        """
        for engine, ranks in self.placement.engine_ranks[plan.walk.name].items():
            if len(ranks) > 1:
                self.router.pin(request_id, engine, ranks[replica % len(ranks)])

    def _node_ranks(self, request_id: str, plan: WalkPlan) -> dict[str, int]:
        """The rank each node of ``plan`` runs on for this request (raises ``PlacementError``
        for an unplaced walk or node). Engines placed on the same replicas follow the first of
        them routed in this walk, so a loop over several replicated engines stays on one
        replica."""
        walk, found = plan.walk.name, {}
        placed = {
            n.name: tuple(self.placement.ranks_for(walk, n.name)) for n in plan.nodes.values()
        }
        chosen: dict[tuple[int, ...], int] = {}  # replica set -> this request's rank in it
        for node in plan.nodes.values():  # a rank the request already holds in a set leads
            held = self.router.rank_of(request_id, node.engine)
            if len(placed[node.name]) > 1 and held in placed[node.name]:
                chosen.setdefault(placed[node.name], held)
        for node in plan.nodes.values():
            ranks = placed[node.name]
            if len(ranks) == 1:
                found[node.name] = ranks[0]
                continue
            follow = chosen.get(ranks)
            if follow is not None and self.router.rank_of(request_id, node.engine) is None:
                self.router.pin(request_id, node.engine, follow)
            found[node.name] = self.router.route(request_id, node.engine, ranks).rank
            chosen.setdefault(ranks, found[node.name])
        return found

    def _moves(
        self, request_id: str, plan: WalkPlan, node_ranks: Mapping[str, int]
    ) -> dict[int, dict[str, int]]:
        """Per destination rank, the engines whose state for this request lives on another
        rank (engine -> that rank); and from now on each engine's state lives where ``plan``
        runs it."""
        moves: dict[int, dict[str, int]] = {}
        for node in plan.nodes.values():
            rank = node_ranks[node.name]
            home = self._homes.get((request_id, node.engine))
            if home is not None and home != rank:
                moves.setdefault(rank, {})[node.engine] = home
            self._homes[(request_id, node.engine)] = rank
        return moves

    def _split(self, plan: WalkPlan, node_ranks: Mapping[str, int]) -> WalkSplit:
        key = (plan.walk.name, tuple(node_ranks.items()))
        if key not in self._splits:
            self._splits[key] = split_walk(plan, node_ranks)
        split = self._splits[key]
        if split is None:
            # Engines of one loop on different replica sets routed a request apart (validation
            # refuses a loop placed across ranks, but cannot know where a router sends a
            # request; engines on the same replica set follow one replica, see _node_ranks).
            raise PlacementError(
                f"walk {plan.walk.name!r}: a loop would span ranks for this request "
                f"({dict(node_ranks)}); a loop lives on one rank: give the engines of each "
                "loop the same single rank, or the same replica set"
            )
        return split

    def open_walk(
        self,
        request_id: str,
        plan: WalkPlan,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
    ) -> WalkControl:
        """Start ``plan`` on the worker that holds all its nodes, or as segments on the ranks
        that do, moving the request's state there first where it lives elsewhere. Never
        raises: errors (an unplaced walk, a loop routed across ranks) reach ``sink``."""
        try:
            node_ranks = self._node_ranks(request_id, plan)
            ranks = set(node_ranks.values())
            split = None if len(ranks) == 1 else self._split(plan, node_ranks)
        except PlacementError as exc:
            sink.end({}, exc)
            return _Ended()
        moves = self._moves(request_id, plan, node_ranks)
        self._touched[request_id].update(ranks)
        if split is None:
            (rank,) = ranks
            return self.ranks.open_walk_on(
                rank,
                request_id,
                plan.walk.name,
                inputs,
                params,
                persisted,
                sink,
                moves=moves.get(rank),
            )
        return self.ranks.open_segments(request_id, split, inputs, params, persisted, sink, moves)

    async def release(self, request_id: str) -> None:
        """Release the request on every rank it ran on; completes even when cancelled."""
        with anyio.CancelScope(shield=True):
            for rank in sorted(self._touched.pop(request_id, ())):
                await self.ranks.release_on(rank, request_id)
        self.router.finish(request_id)
        for key in [k for k in self._homes if k[0] == request_id]:
            del self._homes[key]


class _Ended:
    """The ``WalkControl`` of a walk that ended before it started."""

    def ack(self, count: int) -> None:
        """Nothing to credit."""

    def cancel(self) -> None:
        """Nothing to stop."""

    async def feed(self, port: PortRef, items: Any) -> None:
        """Nothing reads the input."""

    def end_input(self, port: PortRef) -> None:
        """Nothing reads the input."""
