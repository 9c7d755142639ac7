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
step's outputs. Whether a step's tokens get blocks is the engine's shared admission rule
(``admission.py``); this module holds the protocol, the scratch key and the forward itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mstar_async.errors import EngineError

from .allocator import AppendPlan, PagedKVAllocator
from .batch import BatchLayout

__all__ = ["QueryModel", "ScratchKey", "run_queries"]


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
class ScratchKey:
    """The allocator key of an ``attend`` step's scratch fork of sequence ``of``.

    Why a key type of its own: a scratch sequence lives for one forward and must never collide
    with a request's sequence or with another step's scratch in the same forward (``index`` is
    the step's place in it); ``request_id`` tells the admission rule whose memory it pins.
    """

    of: Hashable
    index: int
    request_id: str


def run_queries(
    model: QueryModel,
    op: str,
    inputs: Sequence[Mapping[str, Any]],
    plans: Sequence[AppendPlan],
    *,
    allocator: PagedKVAllocator,
    plan: Callable[[BatchLayout], Any],
    attention: Callable[[Any], Any],
) -> list[dict[str, Any]]:
    """Run one non-causal forward of the query tokens already appended by ``plans`` (one per
    step, in order; their copy-on-write copies done) and return each step's outputs.

    Raises:
        EngineError: the model returns the wrong number of outputs; what ``forward_queries``
            raises.
    """
    meta = plan(BatchLayout.from_plans(allocator, plans, causal=False))
    outputs = model.forward_queries(op, inputs, attention(meta))
    if len(outputs) != len(inputs):
        raise EngineError(
            f"{type(model).__name__}.forward_queries returned {len(outputs)} outputs "
            f"for {len(inputs)} steps"
        )
    return outputs
