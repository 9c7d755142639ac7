"""The one seam between the conductor and whatever holds requests' state (engines)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mstar_async.graph import WalkPlan


class StepExecutor(Protocol):
    """Runs the steps of the walks it hosts and holds what engines keep for requests: a
    worker's batching loop in this process, or the placement's worker processes."""

    async def release(self, request_id: str) -> None:
        """The request is over: free what engines hold for it. Idempotent, never raises, and
        completes even when the caller is being cancelled."""
        ...


@runtime_checkable
class ReplicaPinner(Protocol):
    """An executor whose engines may run as several replicas, and that can send a request to
    one replica in particular (what ``RequestContext.run_on_replicas`` needs). An executor
    without replicas (the in-process batching loop) need not be one."""

    def replica_count(self, plan: WalkPlan) -> int:
        """How many runs reach every replica of ``plan``'s engines: the most replicas any of
        them has in that walk (1: none is replicated)."""
        ...

    def pin_replica(self, request_id: str, plan: WalkPlan, replica: int) -> None:
        """Send ``request_id``'s steps of each replicated engine of ``plan`` to that engine's
        replica number ``replica`` (modulo its count), until ``release(request_id)``. Call it
        before the request runs anything."""
        ...
