"""The engine contract: run a batch of steps from different requests in one forward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    """A component that runs batched steps; the worker's batching loop drives it.

    ``forward`` is synchronous and runs off the event loop's thread, one call at a time per
    worker. ``batch[i]`` holds the inputs of request ``request_ids[i]``'s step (port name ->
    value); the result holds one output mapping per step, in the same order.
    """

    def forward(
        self, op: str, batch: Sequence[Mapping[str, Any]], request_ids: Sequence[str]
    ) -> list[dict[str, Any]]:
        """Run one batched forward of ``op``.

        Raises:
            EngineError: unknown op, inputs it cannot batch, or outputs missing.
        """
        ...

    def release(self, request_id: str) -> None:
        """Drop everything held for ``request_id`` (KV blocks, caches); idempotent, never raises."""
        ...
