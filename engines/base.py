"""The engine contract: run a batch of steps from different requests in one forward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class Step:
    """One step of one request: run ``op`` on ``inputs`` (port name -> value).

    ``budget`` is set by the scheduler: how many tokens this step may process in this forward
    (a long prompt's prefill is split over several forwards). 0 means no limit. An engine
    computes at most that many of a step's tokens where the work can be split (returning
    ``None`` until the step is done); a step that cannot be split (a stateless op, a query
    step) runs whole.

    ``ahead`` is set on a step the worker launched before its walk asked for it (a loop's next
    step, see the ``Engine`` docstring): an engine with ``discard`` keeps what it needs to
    undo it.
    """

    request_id: str
    op: str
    inputs: Mapping[str, Any]
    budget: int = 0
    ahead: bool = False


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
    """A component that runs batched steps; a worker's scheduler drives it.

    ``forward`` and ``release`` (and ``MovableState``'s methods, where an engine has them) are
    synchronous and run off the event loop's thread, one call at a time per worker, so an
    engine needs no locks of its own. ``cost`` runs on the scheduler's thread between forwards.

    A loop's next step may run before the walk has read this one's outputs and decided to go
    on, where the engine allows it: with a class attribute ``stateless_steps = True`` (its
    steps leave nothing behind in it: a step's outputs are all it does), or with a method
    ``discard(step)`` that undoes a step marked ``ahead`` (a KV append, a sampler's draw). When
    the walk stops instead, the worker drops the step's outputs and calls ``discard`` (also for
    a step that never ran) between forwards, before the engine's next forward or the request's
    release. Such an engine must fail a bad step alone (return its error): a step run past the
    loop's end (an action plan's last step) may be invalid, and must not fail the others.
    """

    def cost(self, step: Step) -> int:
        """Tokens ``step`` still needs to finish: what is left of a prompt, the rows or frames
        a step feeds, 1 for a step with nothing to count. The scheduler grants a budget from
        it; an error here costs the step 1 and it gets its error from ``forward``."""
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


@runtime_checkable
class MovableState(Protocol):
    """What an engine that holds per-request state (KV blocks, a sampler) may add so that a
    request can run one walk on one rank and the next on another (prefill and decode
    disaggregated): its state is exported on the first rank, carried worker to worker and
    imported on the second. Optional: an engine without these methods holds nothing that has
    to move. Both run on the forward thread between forwards, like ``forward``.
    """

    def export_state(self, request_id: str) -> Any:
        """A copy of what ``request_id`` holds here, to move to another rank's engine; the
        request keeps holding it here until ``release``. ``None`` when nothing is held.

        Raises:
            EngineError: the request's state cannot move now (a step half computed).
        """
        ...

    def import_state(self, request_id: str, state: Any) -> None:
        """Take over what ``export_state`` of a peer engine gave; ``None`` imports nothing.

        Raises:
            KVCacheFull: no room for it here (nothing changed; the worker retries it once
                memory is freed).
            EngineError: the request is already held here.
        """
        ...


def group_by_op(steps: Sequence[Step]) -> dict[str, list[int]]:
    """Indices of ``steps`` grouped by op, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        groups.setdefault(step.op, []).append(i)
    return groups


__all__ = ["WAIT", "Engine", "MovableState", "Step", "StepResult", "Wait", "group_by_op"]
