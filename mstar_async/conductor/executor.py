"""The one seam between the conductor and whatever runs node steps."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from mstar_async.graph import WalkPlan
from mstar_async.transport import StepCall, TensorRef


class StepExecutor(Protocol):
    """Runs node steps: a worker's batching loop in this process, or a client of remote workers."""

    async def submit(self, call: StepCall) -> dict[str, Any]:
        """Run one step and return its outputs by port name.

        Must be cancel-safe: a cancelled submit leaves no step behind that anyone waits for.
        """
        ...

    async def release(self, request_id: str) -> None:
        """The request is over: free what engines hold for it. Idempotent, never raises, and
        completes even when the caller is being cancelled."""
        ...


@runtime_checkable
class TensorFetcher(Protocol):
    """An executor whose steps may answer with :class:`~mstar_async.transport.TensorRef`
    handles (tensors left on workers), and that can bring one's tensor here."""

    async def fetch(self, ref: TensorRef) -> torch.Tensor:
        """The tensor behind ``ref``; cancel-safe."""
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


async def materialize(executor: StepExecutor, value: Any) -> Any:
    """``value``, or the tensor behind it when it is a handle: for the places where the
    conductor must see a value itself (what a request program receives, a loop's ``until``
    predicate, a chunk policy's input). Cancel-safe.

    Raises:
        WorkerLost, TensorNotHeld: the tensor could not be fetched.
        TypeError: a handle from an executor that cannot fetch (a bug).
    """
    if not isinstance(value, TensorRef):
        return value
    if not isinstance(executor, TensorFetcher):
        raise TypeError(f"{type(executor).__qualname__} returned a tensor handle it cannot fetch")
    return await executor.fetch(value)
