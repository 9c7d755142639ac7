"""BlockPool: LIFO free list, reference counts, all-or-nothing allocation, misuse errors."""

from __future__ import annotations

import pytest

from mstar_async.engines.kv.block_pool import BlockPool
from mstar_async.errors import EngineError, KVCacheFull


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(5)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 5, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert (pool.num_free, pool.num_used) == (2, 3)
    assert [pool.refcount(b) for b in range(5)] == [1, 1, 1, 0, 0]
    pool.check_invariants()


def test_lifo_reuses_most_recently_freed_first() -> None:
    pool = BlockPool(6)
    first = pool.allocate(3)  # [0, 1, 2]
    pool.allocate(1)  # [3]
    assert pool.free(first) == [0, 1, 2]
    # A table freed as [0, 1, 2] comes back in the same order, before untouched blocks 4, 5.
    assert pool.allocate(4) == [0, 1, 2, 4]
    pool.check_invariants()


def test_allocate_zero_is_empty() -> None:
    pool = BlockPool(1)
    assert pool.allocate(0) == []
    assert pool.can_allocate(0)
    assert pool.num_free == 1


def test_allocate_too_many_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(KVCacheFull, match=r"asked for 2 block\(s\), 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.free_blocks() == [3]
    pool.check_invariants()


def test_refcounting_frees_at_zero() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.incref([a, a, b])
    assert (pool.refcount(a), pool.refcount(b)) == (3, 2)
    assert pool.decref([a, b]) == []
    assert pool.decref([a]) == []
    assert pool.decref([a, b]) == [a, b]
    assert pool.is_free(a) and pool.is_free(b)
    assert pool.num_free == 3
    pool.check_invariants()


def test_decref_of_free_block_raises() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.decref([a])
    with pytest.raises(EngineError, match="refcount 0"):
        pool.decref([a])
    with pytest.raises(EngineError, match="refcount 0"):
        pool.free([1])


def test_decref_checks_everything_before_changing_anything() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    with pytest.raises(EngineError):
        pool.decref([a, b, b])  # b is held once but listed twice
    assert (pool.refcount(a), pool.refcount(b)) == (1, 1)
    with pytest.raises(EngineError):
        pool.decref([a, 7])
    assert pool.refcount(a) == 1
    pool.check_invariants()


def test_incref_of_free_or_unknown_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    with pytest.raises(EngineError, match="free block 2"):
        pool.incref([a, 2])
    assert pool.refcount(a) == 1
    with pytest.raises(EngineError, match="out of range"):
        pool.incref([3])
    with pytest.raises(EngineError, match="out of range"):
        pool.refcount(-1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_constructor_rejects_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)  # type: ignore[arg-type]


def test_negative_count_is_misuse() -> None:
    pool = BlockPool(2)
    with pytest.raises(EngineError):
        pool.allocate(-1)
    with pytest.raises(EngineError):
        pool.can_allocate(-1)
