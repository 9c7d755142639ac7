"""The engine contract: run a batch of steps from different requests in one forward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class Step:
    """One step of one request: run ``op`` on ``inputs`` (port name -> value).

    ``budget`` is set by the batching loop: how many tokens this step may process in this
    forward (a long prompt's prefill is split over several forwards). 0 means no limit.
    """

    request_id: str
    op: str
    inputs: Mapping[str, Any]
    budget: int = 0


class Wait:
    """The result of a step that could not run for lack of memory: submit it again once
    another request has released what it holds."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WAIT"


#: The one ``Wait`` instance engines return.
WAIT = Wait()

#: What an engine returns for one step: its outputs; ``None`` (progress made, come back);
#: ``WAIT`` (no memory now); or the exception that failed this step alone.
StepResult = dict[str, Any] | None | Wait | Exception


@runtime_checkable
class Engine(Protocol):
    """A component that runs batched steps; a worker's batching loop drives it.

    ``forward`` and ``release`` are synchronous and run off the event loop's thread, one call at a
    time per worker, so an engine needs no locks of its own.
    """

    def cost(self, step: Step) -> int:
        """Tokens ``step`` still needs to finish (1 for a step that is done in one go)."""
        ...

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Run one batched forward over ``steps``; one ``StepResult`` per step, in order.

        Raises:
            EngineError: unknown op, inputs it cannot batch, missing outputs. A raised error
                fails every step of this forward; an error returned as a result fails one.
        """
        ...

    def release(self, request_id: str) -> None:
        """Drop everything held for ``request_id`` (KV blocks, generators); idempotent."""
        ...


def group_by_op(steps: Sequence[Step]) -> dict[str, list[int]]:
    """Indices of ``steps`` grouped by op, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        groups.setdefault(step.op, []).append(i)
    return groups


__all__ = ["WAIT", "Engine", "Step", "StepResult", "Wait", "group_by_op"]
