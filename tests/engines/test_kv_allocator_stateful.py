"""Stateful property test of PagedKVAllocator against a model of token contents.

The model gives every appended token a unique label and keeps an abstract slot store
(slot -> label). Applying each AppendPlan (copies first, then writes) to that store and reading
every sequence back through its block table must give its exact token history: that checks slot
mapping and copy-on-write together (a write into a block another sequence still reads shows up
as a wrong label there).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar_async.engines.kv import AppendPlan, PagedKVAllocator
from mstar_async.errors import KVCacheFull


class AllocatorMachine(RuleBasedStateMachine):
    alloc: PagedKVAllocator

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[Hashable, list[int]] = {}
        self.store: dict[int, int] = {}
        self.next_id = 0
        self.next_label = 0

    @initialize(num_blocks=st.integers(1, 13), block_size=st.integers(1, 5))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.alloc = PagedKVAllocator(num_blocks, block_size)

    # ------------------------------------------------------------------ helpers

    def _snapshot(self) -> object:
        a = self.alloc
        return (
            {s: (a.block_table(s), a.num_tokens(s)) for s in a.seq_ids()},
            [a.pool.refcount(b) for b in range(a.num_blocks)],
            a.pool.free_blocks(),
        )

    def _apply(self, plan: AppendPlan) -> None:
        bs = self.alloc.block_size
        assert plan.start == len(self.history[plan.seq_id])
        for src, dst in plan.copies:
            assert src not in plan.new_blocks and dst in plan.new_blocks
            for off in range(bs):
                if src * bs + off in self.store:
                    self.store[dst * bs + off] = self.store[src * bs + off]
        for slot in plan.slots:
            self.store[slot] = self.next_label
            self.history[plan.seq_id].append(self.next_label)
            self.next_label += 1

    def _pick(self, data: st.DataObject) -> Hashable:
        return data.draw(st.sampled_from(sorted(self.history, key=repr)))

    # ------------------------------------------------------------------ rules

    @rule()
    def add(self) -> None:
        seq = f"s{self.next_id}"
        self.next_id += 1
        self.alloc.add(seq)
        self.history[seq] = []

    @precondition(lambda self: self.history)
    @rule(data=st.data(), n=st.integers(0, 12))
    def append(self, data: st.DataObject, n: int) -> None:
        seq = self._pick(data)
        fits = self.alloc.can_append(seq, n)
        before = self._snapshot()
        try:
            plan = self.alloc.append(seq, n)
        except KVCacheFull:
            assert not fits
            assert self._snapshot() == before
            return
        assert fits
        assert len(plan.slots) == n
        self._apply(plan)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=st.integers(0, 3))
    def append_beyond_capacity(self, data: st.DataObject, extra: int) -> None:
        seq = self._pick(data)
        bs = self.alloc.block_size
        n = (self.alloc.num_free_blocks + 1 + extra) * bs
        assert not self.alloc.can_append(seq, n)
        before = self._snapshot()
        try:
            self.alloc.append(seq, n)
        except KVCacheFull:
            pass
        else:
            raise AssertionError("append beyond capacity did not raise KVCacheFull")
        assert self._snapshot() == before

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def append_batch(self, data: st.DataObject) -> None:
        seqs = data.draw(
            st.lists(st.sampled_from(sorted(self.history, key=repr)), unique=True, min_size=1)
        )
        requests = {s: data.draw(st.integers(0, 6)) for s in seqs}
        need = self.alloc.blocks_needed_batch(requests)
        before = self._snapshot()
        free_before = self.alloc.num_free_blocks
        try:
            plans = self.alloc.append_batch(requests)
        except KVCacheFull:
            assert need > free_before
            assert self._snapshot() == before
            return
        assert need <= free_before
        assert free_before - self.alloc.num_free_blocks == need  # the count was exact
        for plan in plans:
            self._apply(plan)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data)
        child = f"s{self.next_id}"
        self.next_id += 1
        free_before = self.alloc.num_free_blocks
        self.alloc.fork(parent, child)
        assert self.alloc.num_free_blocks == free_before
        self.history[child] = list(self.history[parent])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self._pick(data)
        self.alloc.free(seq)
        del self.history[seq]

    @precondition(lambda self: self.history)
    @rule(data=st.data(), n=st.integers(1, 8))
    def cancel_mid_step(self, data: st.DataObject, n: int) -> None:
        """A request cancelled after its blocks were planned but before the step ran."""
        seq = self._pick(data)
        if self.alloc.can_append(seq, n):
            self.alloc.append(seq, n)  # the plan is dropped unused
        self.alloc.free(seq)
        del self.history[seq]

    @rule()
    def free_everything(self) -> None:
        for seq in list(self.history):
            self.alloc.free(seq)
            del self.history[seq]
        assert self.alloc.num_free_blocks == self.alloc.num_blocks

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bookkeeping_agrees(self) -> None:
        a = self.alloc
        assert a.num_free_blocks + a.num_used_blocks == a.num_blocks
        holders = [0] * a.num_blocks
        for seq in a.seq_ids():
            table = a.block_table(seq)
            assert len(table) == math.ceil(a.num_tokens(seq) / a.block_size)
            for block in table:
                holders[block] += 1
        free = set(a.pool.free_blocks())
        for block in range(a.num_blocks):
            assert a.pool.refcount(block) == holders[block]
            assert (block in free) == (holders[block] == 0)  # never both free and used
        assert len(free) == a.num_free_blocks
        a.check_invariants()

    @invariant()
    def contents_match_history(self) -> None:
        a = self.alloc
        bs = a.block_size
        assert set(a.seq_ids()) == set(self.history)
        for seq, labels in self.history.items():
            assert a.num_tokens(seq) == len(labels)
            table = a.block_table(seq)
            read = [self.store[table[p // bs] * bs + p % bs] for p in range(len(labels))]
            assert read == labels, f"{seq}: read {read}, wrote {labels}"

    def teardown(self) -> None:
        for seq in list(self.history):
            self.alloc.free(seq)
        assert self.alloc.num_free_blocks == self.alloc.num_blocks  # nothing leaked
        self.alloc.check_invariants()


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)
TestAllocatorMachine = AllocatorMachine.TestCase
