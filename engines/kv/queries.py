"""Query tokens over a cached prefix: the ``extend`` and ``attend`` ops of the KV engine.

A diffusion or flow-matching head (an image's latent tokens, a policy's noisy actions) runs
many forwards of the same new tokens over one fixed prefix. Its tokens see the whole prefix and
each other in both directions, and only the last forward's result matters, so their K/V must not
stay in the sequence. ``attend`` forks the sequence into a scratch sequence (no block is taken:
the prefix is shared by reference count), appends the new tokens there (copy-on-write gives it a
private copy of a partly filled last block), runs one non-causal paged forward and frees the
scratch sequence, all inside one engine forward. ``extend`` is the same forward appended to the
sequence itself, so its tokens stay (an image's encoder tokens in a prompt).

The model decides what the new tokens are: ``query_length`` counts them from a step's inputs and
``forward_queries`` embeds them, runs its layers through the attention seam and makes each
step's outputs. Pure bookkeeping aside, this module touches tensors only through that seam.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mstar_async.engines.base import WAIT, Step, StepResult
from mstar_async.errors import EngineError, KVCacheFull

from .allocator import PagedKVAllocator
from .batch import BatchLayout

__all__ = ["QueryModel", "run_queries"]


@runtime_checkable
class QueryModel(Protocol):
    """What ``extend`` and ``attend`` need of a model besides its token forward."""

    def query_length(self, inputs: Mapping[str, Any]) -> int:
        """How many new tokens one step with these inputs adds to its sequence's forward.

        Raises:
            EngineError: the inputs are not what the model's query ops take.
        """
        ...

    def forward_queries(
        self, op: str, inputs: Sequence[Mapping[str, Any]], attention: Any
    ) -> list[dict[str, Any]]:
        """Run the new tokens of every step (flat, in order) through ``attention`` (whose
        ``positions`` give each token's index in its sequence) and return each step's outputs.

        Raises:
            EngineError: the inputs are not what the model's query ops take.
        """
        ...


@dataclass(frozen=True, slots=True)
class _Scratch:
    # Why a key type of its own: a scratch sequence lives for one forward and must never collide
    # with a request's sequence or with another step's scratch in the same forward.
    of: Hashable
    index: int


def run_queries(
    model: QueryModel,
    op: str,
    steps: Sequence[Step],
    keys: Sequence[Hashable],
    *,
    allocator: PagedKVAllocator,
    copy_blocks: Callable[[list[tuple[int, int]]], None],
    plan: Callable[[BatchLayout], Any],
    attention: Callable[[Any], Any],
    keep: bool,
    observe: Callable[[], None] | None = None,
) -> list[StepResult]:
    """Run one non-causal forward of the steps' query tokens over their sequences.

    ``keys`` are the allocator ids of the steps' sequences. With ``keep`` the tokens are
    appended to those sequences; without, to scratch forks that are freed before this returns,
    whatever happens. A step that does not fit in the free blocks now gets ``WAIT`` (or
    ``KVCacheFull`` when it could never fit); two steps on one kept sequence run one per
    forward. ``observe`` is called once the forward's blocks are allocated (its peak).

    Raises:
        EngineError: the model returns the wrong number of outputs; what ``forward_queries``
            raises.
    """
    lengths = [model.query_length(step.inputs) for step in steps]
    results: list[StepResult] = [None] * len(steps)
    scratch: list[_Scratch] = []
    try:
        chosen: dict[Hashable, int] = {}
        admitted: list[int] = []
        for i, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            target: Hashable = key
            if not keep:
                target = _Scratch(key, i)
                allocator.fork(key, target)
                scratch.append(target)
            trial = {**chosen, target: n}
            if target not in chosen and allocator.can_append_batch(trial):
                chosen, admitted = trial, [*admitted, i]
            else:
                results[i] = _wait_or_fail(allocator, steps[i], key, n)
        if admitted:
            plans = allocator.append_batch(chosen)
            if observe is not None:
                observe()
            copy_blocks([c for p in plans for c in p.copies])
            meta = plan(BatchLayout.from_plans(allocator, plans, causal=False))
            batch = [steps[i].inputs for i in admitted]
            outputs = model.forward_queries(op, batch, attention(meta))
            if len(outputs) != len(admitted):
                raise EngineError(
                    f"{type(model).__name__}.forward_queries returned {len(outputs)} outputs "
                    f"for {len(admitted)} steps"
                )
            for i, out in zip(admitted, outputs, strict=True):
                results[i] = out
    finally:
        for target in scratch:
            allocator.free(target)
    return results


def _wait_or_fail(allocator: PagedKVAllocator, step: Step, key: Hashable, n: int) -> StepResult:
    capacity = allocator.num_blocks * allocator.block_size
    total = allocator.num_tokens(key) + n
    if total <= capacity:
        return WAIT
    return KVCacheFull(
        f"request {step.request_id}: {step.op} needs KV for {total} tokens but the whole cache "
        f"holds {capacity}; give the engine a larger kv_cache_bytes or use fewer query tokens"
    )
