"""The one seam between the conductor and whatever runs node steps."""

from __future__ import annotations

from typing import Any, Protocol

from mstar_async.transport import StepCall


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
