"""Sending each node step to the rank that placement names for it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

import anyio
import torch

from mstar_async.placement import ReplicaRouter, ResolvedPlacement
from mstar_async.transport import EXPORT_OP, IMPORT_OP, StepCall, TensorRef


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


class PlacedExecutor:
    """A ``StepExecutor`` that routes each step by (walk, node) through a placement.

    A node placed on several ranks is a replica set: a request goes to the least loaded
    replica and stays there (its state lives on one rank).

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

    def rank_for(self, call: StepCall) -> int:
        """The rank that runs ``call``.

        Raises:
            PlacementError: the walk or node is not placed.
        """
        ranks = self.placement.ranks_for(call.walk, call.node)
        if len(ranks) == 1:
            return ranks[0]
        return self.router.route(call.request_id, call.engine, ranks).rank

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
