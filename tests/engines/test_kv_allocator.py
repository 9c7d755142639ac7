"""PagedKVAllocator with exact block ids and slots, BatchLayout, byte budgets, purity."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from mstar_async.engines.kv import (
    AppendPlan,
    BatchLayout,
    PagedKVAllocator,
    blocks_for_budget,
    bytes_per_block,
)
from mstar_async.errors import EngineError, KVCacheFull

KV_DIR = Path(__file__).resolve().parents[2] / "engines" / "kv"


def refcounts(alloc: PagedKVAllocator) -> list[int]:
    return [alloc.pool.refcount(b) for b in range(alloc.num_blocks)]


def test_worked_example_block_size_4() -> None:
    """Every id below follows from the LIFO free list that hands out 0, 1, 2, ... first."""
    alloc = PagedKVAllocator(num_blocks=8, block_size=4)
    alloc.add("A")
    plan = alloc.append("A", 6)
    assert plan == AppendPlan("A", 0, (0, 1, 2, 3, 4, 5), (), (0, 1))
    assert alloc.block_table("A") == [0, 1]

    alloc.fork("A", "B")  # B shares blocks 0 (full) and 1 (2 of 4 slots used)
    assert alloc.block_table("B") == [0, 1] and alloc.num_tokens("B") == 6
    assert refcounts(alloc)[:3] == [2, 2, 0]
    assert alloc.num_free_blocks == 6

    plan = alloc.append("B", 1)  # into shared partial block 1 -> private copy in block 2
    assert plan.copies == ((1, 2),)
    assert plan.slots == (2 * 4 + 2,)
    assert plan.new_blocks == (2,)
    assert alloc.block_table("B") == [0, 2]
    assert refcounts(alloc)[:3] == [2, 1, 1]

    plan = alloc.append("A", 1)  # A now holds block 1 alone: no copy
    assert plan.copies == () and plan.slots == (1 * 4 + 2,)

    plan = alloc.append("A", 2)  # slot 7 fills block 1, slot 8 opens block 3
    assert plan.slots == (7, 3 * 4 + 0) and plan.new_blocks == (3,)
    assert alloc.block_table("A") == [0, 1, 3] and alloc.num_tokens("A") == 9

    alloc.fork("A", "C")
    plan = alloc.append("C", 3)  # block 3 holds 1 token and is shared -> copy into 4
    assert plan.copies == ((3, 4),)
    assert plan.slots == (17, 18, 19)
    assert alloc.block_table("C") == [0, 1, 4]

    alloc.fork("B", "D")  # B: 7 tokens in [0, 2]
    plan = alloc.append("B", 1)
    assert plan.copies == ((2, 5),) and plan.slots == (5 * 4 + 3,)
    assert alloc.block_table("B") == [0, 5] and alloc.block_table("D") == [0, 2]

    # Full shared blocks stay shared: block 0 is in every table, block 1 in A and C.
    assert refcounts(alloc) == [4, 2, 1, 1, 1, 1, 0, 0]
    alloc.check_invariants()

    assert alloc.free("A") == 1  # only block 3 was A's alone
    assert refcounts(alloc) == [3, 1, 1, 0, 1, 1, 0, 0]
    plan = alloc.append("D", 2)  # D: 7 tokens, alone on block 2; slot 11, then LIFO gives 3
    assert plan.slots == (11, 12) and plan.new_blocks == (3,)
    for seq in ("B", "C", "D"):
        alloc.free(seq)
    assert alloc.num_free_blocks == 8 and len(alloc) == 0
    alloc.check_invariants()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    alloc = PagedKVAllocator(num_blocks=4, block_size=4)
    alloc.add(1)
    alloc.append(1, 4)
    alloc.fork(1, 2)
    assert alloc.blocks_needed(2, 1) == 1
    plan = alloc.append(2, 1)
    assert plan.copies == () and plan.slots == (4,)
    assert alloc.block_table(2) == [0, 1] and alloc.block_table(1) == [0]


def test_append_zero_and_empty_fork() -> None:
    alloc = PagedKVAllocator(num_blocks=2, block_size=4)
    alloc.add("x")
    assert alloc.append("x", 0) == AppendPlan("x", 0, (), (), ())
    alloc.fork("x", "y")
    assert alloc.block_table("y") == [] and alloc.num_tokens("y") == 0
    alloc.append("x", 3)
    alloc.fork("x", "z")
    assert alloc.append("z", 0).copies == ()  # no token written, so no copy


def test_full_pool_raises_and_changes_nothing() -> None:
    alloc = PagedKVAllocator(num_blocks=8, block_size=4)
    alloc.add("a")
    assert not alloc.can_append("a", 33)
    with pytest.raises(KVCacheFull, match=r"'a' needs 9 block\(s\) for 33 more token\(s\), 8 of 8"):
        alloc.append("a", 33)
    assert alloc.num_tokens("a") == 0 and alloc.num_free_blocks == 8
    alloc.append("a", 32)
    assert alloc.num_free_blocks == 0 and alloc.can_append("a", 0)


def test_copy_on_write_with_no_free_block_raises_and_changes_nothing() -> None:
    alloc = PagedKVAllocator(num_blocks=2, block_size=4)
    alloc.add("a")
    alloc.append("a", 6)
    alloc.fork("a", "b")
    assert alloc.blocks_needed("b", 1) == 1 and not alloc.can_append("b", 1)
    before = (alloc.block_table("a"), alloc.block_table("b"), refcounts(alloc))
    with pytest.raises(KVCacheFull):
        alloc.append("b", 1)
    assert (alloc.block_table("a"), alloc.block_table("b"), refcounts(alloc)) == before
    assert alloc.num_tokens("b") == 6
    alloc.check_invariants()


def test_batch_counts_one_copy_when_both_forks_append() -> None:
    alloc = PagedKVAllocator(num_blocks=3, block_size=4)
    alloc.add("a")
    alloc.append("a", 6)  # [0, 1]
    alloc.fork("a", "b")
    # Each alone would copy block 1, but once "a" has copied, "b" holds block 1 alone.
    assert alloc.blocks_needed("a", 1) == alloc.blocks_needed("b", 1) == 1
    assert alloc.blocks_needed_batch({"a": 1, "b": 1}) == 1
    plans = alloc.append_batch({"a": 1, "b": 1})
    assert [p.copies for p in plans] == [((1, 2),), ()]
    assert [p.slots for p in plans] == [(10,), (6,)]
    alloc.check_invariants()


def test_batch_that_does_not_fit_changes_nothing() -> None:
    alloc = PagedKVAllocator(num_blocks=3, block_size=4)
    alloc.add("a")
    alloc.add("b")
    alloc.append("a", 4)
    assert not alloc.can_append_batch({"a": 4, "b": 5})  # 1 + 2 blocks, 2 free
    with pytest.raises(KVCacheFull, match="batch of 2"):
        alloc.append_batch({"a": 4, "b": 5})
    assert (alloc.num_tokens("a"), alloc.num_tokens("b")) == (4, 0)
    assert alloc.num_free_blocks == 2


def test_misuse_raises_engine_error() -> None:
    alloc = PagedKVAllocator(num_blocks=2, block_size=2)
    alloc.add("a")
    with pytest.raises(EngineError, match="already exists"):
        alloc.add("a")
    for call in (
        lambda: alloc.append("nope", 1),
        lambda: alloc.free("nope"),
        lambda: alloc.block_table("nope"),
        lambda: alloc.num_tokens("nope"),
        lambda: alloc.fork("nope", "b"),
        lambda: alloc.append("a", -1),
        lambda: alloc.fork("a", "a"),
        lambda: alloc.append_batch({"a": 1, "nope": 1}),
    ):
        with pytest.raises(EngineError):
            call()
    assert alloc.num_tokens("a") == 0 and alloc.num_free_blocks == 2
    alloc.free("a")
    with pytest.raises(EngineError, match="unknown sequence"):
        alloc.free("a")
    with pytest.raises(ValueError, match="block_size"):
        PagedKVAllocator(4, 0)


def test_batch_layout_from_plans_mixes_prefill_and_decode() -> None:
    alloc = PagedKVAllocator(num_blocks=8, block_size=4)
    alloc.add("p")
    alloc.add("d")
    alloc.append("d", 5)  # [0, 1]
    plans = alloc.append_batch({"p": 3, "d": 1})
    layout = BatchLayout.from_plans(alloc, plans)
    assert layout.seq_ids == ("p", "d")
    assert layout.block_tables == ((2,), (0, 1))
    assert layout.context_lens == (3, 6) and layout.query_lens == (3, 1)
    assert layout.slot_mapping == (8, 9, 10, 5)
    assert layout.positions() == [0, 1, 2, 5]
    assert layout.num_query_tokens == 4 and not layout.is_decode_only
    # A plan goes stale as soon as its sequence grows again.
    alloc.append("d", 1)
    with pytest.raises(EngineError, match="stale"):
        BatchLayout.from_plans(alloc, plans)


def test_batch_layout_rejects_inconsistent_fields() -> None:
    with pytest.raises(EngineError, match="query length 0"):
        BatchLayout(4, ("a",), ((0,),), (3,), (0,), ())
    with pytest.raises(EngineError, match="cannot hold"):
        BatchLayout(4, ("a",), ((0,),), (5,), (1,), (4,))
    with pytest.raises(EngineError, match="slot mapping"):
        BatchLayout(4, ("a",), ((0,),), (3,), (2,), (1,))
    with pytest.raises(EngineError, match="at least one"):
        BatchLayout(4, (), (), (), (), ())
    alloc = PagedKVAllocator(4, 4)
    alloc.add("a")
    alloc.append("a", 2)
    with pytest.raises(EngineError, match="twice"):
        BatchLayout.from_allocator(alloc, [("a", 1), ("a", 1)])


def test_blocks_for_budget() -> None:
    kw = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype_bytes=2)
    per = 2 * 2 * 16 * 4 * 8 * 2
    assert bytes_per_block(**kw) == per == 4096
    assert blocks_for_budget(per * 10, **kw) == 10
    assert blocks_for_budget(per * 10 + per - 1, **kw) == 10
    with pytest.raises(ValueError, match="budget of 4095 bytes fits no block"):
        blocks_for_budget(per - 1, **kw)
    with pytest.raises(ValueError, match="head_dim"):
        blocks_for_budget(per, **{**kw, "head_dim": 0})
    with pytest.raises(ValueError, match="budget_bytes"):
        blocks_for_budget(-1, **kw)


@pytest.mark.parametrize("module", ["block_pool", "allocator", "batch", "sizing"])
def test_bookkeeping_modules_are_pure(module: str) -> None:
    """The bookkeeping never imports torch or asyncio, so it can run anywhere and fast."""
    tree = ast.parse((KV_DIR / f"{module}.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    allowed = {"__future__", "collections", "dataclasses", "math", "mstar_async", "typing"}
    assert imported <= allowed, imported - allowed


def test_slot_formula_matches_tables() -> None:
    alloc = PagedKVAllocator(num_blocks=16, block_size=3)
    alloc.add(0)
    slots: list[int] = []
    for n in (2, 5, 1, 4):
        slots.extend(alloc.append(0, n).slots)
    table = alloc.block_table(0)
    assert len(table) == math.ceil(12 / 3)
    assert slots == [table[p // 3] * 3 + p % 3 for p in range(12)]


def test_flashinfer_is_not_imported_at_module_import() -> None:
    tree = ast.parse((KV_DIR / "flashinfer_backend.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top_level for a in n.names} | {
        n.module for n in top_level if isinstance(n, ast.ImportFrom) and n.module
    }
    assert not any(name and name.startswith("flashinfer") for name in names)


def test_truncate_frees_the_tail_keeps_shared_blocks_and_copies_a_shared_last_block() -> None:
    alloc = PagedKVAllocator(num_blocks=8, block_size=4)
    alloc.add("A")
    alloc.append("A", 10)  # blocks 0, 1, 2 (2 holds tokens 8, 9)
    alloc.fork("A", "B")
    assert alloc.truncate("B", 5) == 0  # block 2 is still A's: nothing freed
    assert alloc.block_table("B") == [0, 1] and alloc.num_tokens("B") == 5
    assert refcounts(alloc)[:3] == [2, 2, 1]
    plan = alloc.append("B", 1)  # block 1 is shared and partly kept: B copies it first
    assert plan.copies == ((1, 3),) and plan.slots == (3 * 4 + 1,)
    # A alone holds blocks 1 (B has its copy) and 2; block 0 stays with B.
    assert alloc.truncate("A", 0) == 2
    assert alloc.block_table("A") == [] and alloc.num_tokens("A") == 0
    assert refcounts(alloc)[:4] == [1, 0, 0, 1]
    alloc.check_invariants()
    with pytest.raises(EngineError, match="holds 6"):
        alloc.truncate("B", 7)
