"""Breaking a KV-memory deadlock: when every holder waits for more, the newest waiter gives way."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from mstar_async.engines.base import WAIT, StepResult
from mstar_async.errors import KVCacheFull

from .allocator import PagedKVAllocator

__all__ = ["preempt_if_stuck"]


def preempt_if_stuck(
    allocator: PagedKVAllocator,
    keys: Sequence[Hashable],
    request_ids: Sequence[str],
    results: list[StepResult],
    *,
    unit: str,
    remedy: str,
) -> None:
    """Fail the last waiting step with ``KVCacheFull`` when every sequence that holds KV
    memory belongs to a step of this forward (``keys[i]`` is step ``i``'s sequence): nobody
    else will free any, so waiting would never end. ``unit`` names the allocator's blocks in
    the message ("blocks", "frames"), ``remedy`` says what the user can change. Never raises.
    """
    holders = {s for s in allocator.seq_ids() if allocator.num_tokens(s) > 0}
    waiting = [i for i, r in enumerate(results) if r is WAIT]
    if waiting and holders <= set(keys):
        victim = waiting[-1]
        results[victim] = KVCacheFull(
            f"request {request_ids[victim]} was preempted: the KV cache "
            f"({allocator.num_blocks} {unit}) is exhausted by requests that all need more; "
            f"{remedy}"
        )
