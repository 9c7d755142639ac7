"""The deadlock breaker shared by the paged engines."""

from __future__ import annotations

from mstar_async.engines.base import WAIT, StepResult
from mstar_async.engines.kv import PagedKVAllocator
from mstar_async.engines.kv.preemption import preempt_if_stuck
from mstar_async.errors import KVCacheFull


def _allocator_held_by(*seqs: str) -> PagedKVAllocator:
    allocator = PagedKVAllocator(num_blocks=4, block_size=4)
    for seq in seqs:
        allocator.add(seq)
        allocator.append(seq, 4)
    return allocator


def _preempt(allocator: PagedKVAllocator, keys: list[str], results: list[StepResult]) -> None:
    preempt_if_stuck(allocator, keys, keys, results, unit="blocks", remedy="add memory")


def test_the_newest_waiter_gives_way_when_every_holder_waits() -> None:
    results: list[StepResult] = [WAIT, WAIT]
    _preempt(_allocator_held_by("a", "b"), ["a", "b"], results)
    assert results[0] is WAIT
    assert isinstance(results[1], KVCacheFull)
    assert "request b was preempted" in str(results[1])
    assert "(4 blocks)" in str(results[1]) and "add memory" in str(results[1])


def test_nobody_is_preempted_while_a_holder_outside_the_forward_may_free_memory() -> None:
    results: list[StepResult] = [WAIT]
    _preempt(_allocator_held_by("a", "other"), ["a"], results)
    assert results == [WAIT]


def test_nobody_is_preempted_when_no_step_waits() -> None:
    results: list[StepResult] = [{"token": 1}]
    _preempt(_allocator_held_by("a"), ["a"], results)
    assert results == [{"token": 1}]
