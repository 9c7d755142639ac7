"""Sending each node step to the rank that placement names for it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch

from mstar_async.graph import PortRef, WalkPlan
from mstar_async.graph.segments import WalkSplit, split_walk
from mstar_async.placement import ReplicaRouter, ResolvedPlacement
from mstar_async.transport import EXPORT_OP, IMPORT_OP, StepCall, TensorRef

if TYPE_CHECKING:
    from mstar_async.conductor.walk_stream import WalkControl, WalkInbox


class RankExecutor(Protocol):
    """Runs steps on numbered ranks (worker processes)."""

    async def submit_to(self, rank: int, call: StepCall) -> dict[str, Any]:
        """Run ``call`` on ``rank`` and return its outputs; cancel-safe."""
        ...

    async def release_on(self, rank: int, request_id: str) -> None:
        """Tell ``rank`` that ``request_id`` is over; never raises."""
        ...

    async def fetch_from(self, rank: int, ref: TensorRef) -> torch.Tensor:
        """The tensor ``rank`` holds under ``ref``; cancel-safe."""
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
    ) -> WalkControl:
        """Run walk ``walk`` on ``rank``'s worker; outputs and end go to ``sink``. Never
        raises."""
        ...

    def open_segments(
        self,
        request_id: str,
        split: WalkSplit,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
    ) -> WalkControl:
        """Run a walk whose nodes span ranks as one segment per rank; outputs and end go to
        ``sink``. Never raises."""
        ...


class PlacedExecutor:
    """A ``StepExecutor`` that routes each step by (walk, node) through a placement, and a
    ``WalkHost`` for the walks workers run whole: on one rank, or as one segment per rank.

    A node placed on several ranks is a replica set: a request goes to the least loaded
    replica and stays there (its state lives on one rank), unless ``pin_replica`` sends it to
    one in particular (``RequestContext.run_on_replicas``).

    Large step outputs stay on the worker that made them: a step's outputs may hold
    :class:`~mstar_async.transport.TensorRef` handles, which later steps take as inputs as they
    are (the worker running them resolves them); :meth:`fetch` brings one here where the
    conductor must see the value itself.
    """

    def __init__(self, placement: ResolvedPlacement, ranks: RankExecutor) -> None:
        self.placement = placement
        self.ranks = ranks
        self.router = ReplicaRouter()
        self._touched: dict[str, set[int]] = defaultdict(set)
        self._homes: dict[tuple[str, str], int] = {}  # (request, engine) -> rank holding state
        self._splits: dict[tuple[str, tuple[tuple[str, int], ...]], WalkSplit | None] = {}

    def rank_for(self, call: StepCall) -> int:
        """The rank that runs ``call``.

        Raises:
            PlacementError: the walk or node is not placed.
        """
        ranks = self.placement.ranks_for(call.walk, call.node)
        if len(ranks) == 1:
            return ranks[0]
        return self.router.route(call.request_id, call.engine, ranks).rank

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

    def _node_ranks(self, request_id: str, plan: WalkPlan) -> dict[str, int] | None:
        """The rank each node of ``plan`` runs on for this request, or ``None`` when the
        request's state for one of their engines sits on another rank (it must move first,
        which the step-by-step path does)."""
        walk, found = plan.walk.name, {}
        for node in plan.nodes.values():
            ranks = self.placement.ranks_for(walk, node.name)
            rank = (
                ranks[0]
                if len(ranks) == 1
                else self.router.route(request_id, node.engine, ranks).rank
            )
            home = self._homes.get((request_id, node.engine))
            if home is not None and home != rank:
                return None
            found[node.name] = rank
        return found

    def _layout(self, request_id: str, plan: WalkPlan) -> int | WalkSplit | None:
        """Where the workers run ``plan`` for this request: the one rank of all its nodes,
        its split into per-rank segments, or ``None`` (the conductor runs it step by step)."""
        node_ranks = self._node_ranks(request_id, plan)
        if node_ranks is None:
            return None
        ranks = set(node_ranks.values())
        if len(ranks) == 1:
            return ranks.pop()
        key = (plan.walk.name, tuple(node_ranks.items()))
        if key not in self._splits:
            self._splits[key] = split_walk(plan, node_ranks)
        return self._splits[key]

    def hosts(self, request_id: str, plan: WalkPlan) -> bool:
        """Whether workers run the whole walk, loops and all: one worker when its nodes sit on
        one rank, one segment per rank when every loop of it does. Else (a loop spanning ranks,
        or a request's state to move first) the conductor drives it step by step. Raises
        ``PlacementError`` for an unplaced walk or node."""
        return self._layout(request_id, plan) is not None

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
        that do (see ``hosts``). Never raises: errors reach ``sink``."""
        layout = self._layout(request_id, plan)
        assert layout is not None, "open_walk on a walk this executor does not host"
        if isinstance(layout, int):
            node_ranks = dict.fromkeys(plan.nodes, layout)
        else:
            node_ranks = dict(layout.node_ranks)
        self._touched[request_id].update(node_ranks.values())
        for node in plan.nodes.values():
            self._homes[(request_id, node.engine)] = node_ranks[node.name]
        if isinstance(layout, int):
            return self.ranks.open_walk_on(
                layout, request_id, plan.walk.name, inputs, params, persisted, sink
            )
        return self.ranks.open_segments(request_id, layout, inputs, params, persisted, sink)

    async def submit(self, call: StepCall) -> dict[str, Any]:
        """Run ``call`` on its rank. Cancel-safe (see the rank executor).

        Raises:
            WorkerLost: the rank's worker died with this step in flight.
            EngineError, MstarError: what the step raised on its worker.
        """
        rank = self.rank_for(call)
        self._touched[call.request_id].add(rank)
        home = self._homes.get((call.request_id, call.engine))
        if home is not None and home != rank:
            await self._move_state(call, home, rank)
        self._homes[(call.request_id, call.engine)] = rank
        return await self.ranks.submit_to(rank, call)

    async def _move_state(self, call: StepCall, src: int, dst: int) -> None:
        # The request's state for this engine (its KV) lives on ``src`` and its next step runs
        # on ``dst`` (prefill and decode disaggregated): carry it across first.
        rid, engine = call.request_id, call.engine
        exported = await self.ranks.submit_to(
            src, StepCall(rid, engine, EXPORT_OP, {}, call.node, call.walk)
        )
        await self.ranks.submit_to(
            dst,
            StepCall(rid, engine, IMPORT_OP, {"state": exported["state"]}, call.node, call.walk),
        )

    async def fetch(self, ref: TensorRef) -> torch.Tensor:
        """The tensor behind ``ref``, from the worker that holds it. Cancel-safe.

        Raises:
            WorkerLost: that worker died; TensorNotHeld: it no longer holds the tensor.
        """
        return await self.ranks.fetch_from(ref.rank, ref)

    async def release(self, request_id: str) -> None:
        """Release the request on every rank it ran on; completes even when cancelled."""
        with anyio.CancelScope(shield=True):
            for rank in sorted(self._touched.pop(request_id, ())):
                await self.ranks.release_on(rank, request_id)
        self.router.finish(request_id)
        for key in [k for k in self._homes if k[0] == request_id]:
            del self._homes[key]
