"""The one admission rule of the paged engines: run what fits, wait for what may fit later, fail
alone what never can, and preempt the newest waiter when every holder waits."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines.base import WAIT
from mstar_async.engines.kv import PagedKVAllocator
from mstar_async.engines.kv.admission import Admission, Demand
from mstar_async.errors import KVCacheFull


def _owner(seq: Hashable) -> str:
    return str(seq[0]) if isinstance(seq, tuple) else str(seq)


def _held_by(*seqs: str, blocks: int = 4, tokens: int = 4) -> Admission:
    allocator = PagedKVAllocator(num_blocks=blocks, block_size=4)
    for seq in seqs:
        allocator.add(seq)
        allocator.append(seq, tokens)
    return Admission(allocator, owner=_owner, remedy="add memory")


def test_everything_that_fits_runs() -> None:
    admission = _held_by("a", "b", blocks=4, tokens=3)
    verdict = admission.admit([Demand("a", "a", 1), Demand("b", "b", 1)])
    assert verdict.admitted == [0, 1] and verdict.results == [None, None]


def test_the_newest_waiter_gives_way_when_every_holder_waits() -> None:
    admission = _held_by("a", "b")
    admission.allocator.append("a", 4)
    admission.allocator.append("b", 4)
    verdict = admission.admit([Demand("a", "a", 1), Demand("b", "b", 1)])
    assert verdict.admitted == [] and verdict.results[0] is WAIT
    victim = verdict.results[1]
    assert isinstance(victim, KVCacheFull) and "request b was preempted" in str(victim)
    assert "(4 blocks)" in str(victim) and "add memory" in str(victim)


def test_nobody_is_preempted_while_a_holder_outside_the_forward_may_free_memory() -> None:
    admission = _held_by("a", "b", "other", "more")
    verdict = admission.admit([Demand("a", "a", 1), Demand("b", "b", 1)])
    assert verdict.results == [WAIT, WAIT] and verdict.failed == []


def test_a_step_bigger_than_the_cache_fails_alone_naming_the_sizes() -> None:
    admission = _held_by("a")
    admission.allocator.add("big")
    verdict = admission.admit([Demand("big", "big", 17), Demand("a", "a", 1)])
    assert verdict.admitted == [1]
    failed = verdict.results[0]
    assert isinstance(failed, KVCacheFull)
    assert "request big needs KV for 17 tokens but the whole cache holds 16" in str(failed)


def test_a_chunk_that_fits_now_still_fails_when_the_whole_step_never_can() -> None:
    admission = _held_by()
    admission.allocator.add("p")
    verdict = admission.admit([Demand("p", "p", 4, total=20, op="prefill")])
    assert verdict.admitted == [] and isinstance(verdict.results[0], KVCacheFull)


def test_blocks_the_request_itself_holds_never_free_for_its_step() -> None:
    # r's prompt holds 2 of 3 blocks with a partly filled last block; a fork of it appending
    # 16 tokens needs a private copy of that block and one more: 2, and only 1 can ever be free.
    allocator = PagedKVAllocator(num_blocks=3, block_size=16)
    allocator.add("r")
    allocator.append("r", 20)
    allocator.fork("r", ("r", "a"))
    admission = Admission(allocator, owner=_owner)
    (failed,) = admission.admit([Demand(("r", "a"), "r", 16, op="attend")]).results
    assert isinstance(failed, KVCacheFull)
    assert "attend needs 2 more blocks for 16 tokens but only 1 of the cache's 3 blocks" in str(
        failed
    )
    assert "the request holds 2" in str(failed)


def test_a_second_step_on_one_sequence_shares_the_first_ones_fate() -> None:
    admission = _held_by("a", "b", "c", tokens=3)
    ran = admission.admit([Demand("a", "a", 1), Demand("a", "a", 1)])
    assert ran.admitted == [0] and ran.results == [None, None]
    admission.allocator.append("c", 1)  # c is full now; its next token needs a block
    admission.allocator.add("d")
    admission.allocator.append("d", 4)  # the pool is full
    waited = admission.admit([Demand("c", "c", 1), Demand("c", "c", 1)])
    assert waited.results == [WAIT, WAIT]


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    forks=st.lists(st.integers(0, 3), max_size=3),
    asks=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(0, 30)), max_size=6),
)
def test_every_verdict_follows_the_rule(
    held: list[int], forks: list[int], asks: list[tuple[int, int, int]]
) -> None:
    allocator = PagedKVAllocator(num_blocks=6, block_size=4)
    seqs: list[Hashable] = []
    for i, n in enumerate(held):
        seq = f"r{i}"
        allocator.add(seq)
        if allocator.can_append(seq, n):
            allocator.append(seq, n)
        seqs.append(seq)
    for j, parent in enumerate(forks):
        if parent < len(held):
            child = (f"r{parent}", f"f{j}")
            allocator.fork(f"r{parent}", child)
            seqs.append(child)
    admission = Admission(allocator, owner=_owner)
    demands = [
        Demand(seqs[s % len(seqs)], _owner(seqs[s % len(seqs)]), now, now + more)
        for s, now, more in asks
    ]
    verdict = admission.admit(demands)
    first: dict[Hashable, int] = {}
    for i, (d, result) in enumerate(zip(demands, verdict.results, strict=True)):
        first.setdefault(d.seq, i)
        if first[d.seq] != i:
            assert result is (WAIT if verdict.results[first[d.seq]] is WAIT else None)
            continue
        could = allocator.blocks_needed(d.seq, d.remaining) <= (
            allocator.num_blocks - admission.pinned(d.request_id)
        )
        if isinstance(result, KVCacheFull):
            assert "preempted" in str(result) or not could
        else:
            assert could
    # What was admitted fits, all at once.
    allocator.append_batch({demands[i].seq: demands[i].now for i in verdict.admitted})
    allocator.check_invariants()
