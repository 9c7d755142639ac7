"""Per-sequence block tables over a :class:`BlockPool`: append, fork with copy-on-write, free.

Pure Python (no torch, no asyncio). The allocator decides *where* each new token's K/V goes
(a flat slot index ``block_id * block_size + offset``) and which whole blocks must be copied
before a write (copy-on-write after a fork); :class:`~mstar_async.engines.kv.cache.PagedKVCache`
does the copying and writing on tensors.

Every change is check-then-commit: a call that raises (``KVCacheFull`` or ``EngineError``)
leaves every table and every reference count as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from mstar_async.errors import EngineError, KVCacheFull

from .block_pool import BlockPool

__all__ = ["AppendPlan", "PagedKVAllocator"]

# Per-call key type, so a ``dict[str, int]`` passes where ``Mapping`` (invariant in its key)
# would reject it for ``Mapping[Hashable, int]``.
_K = TypeVar("_K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """What one ``append`` decided: where the new tokens go and which blocks to copy first.

    Attributes:
        seq_id: the sequence that grew.
        start: position of the first new token (the sequence's length before the append).
        slots: flat slot index ``block_id * block_size + offset`` of each new token, in order.
        copies: ``(src_block, dst_block)`` copy-on-write pairs; copy them (every layer, K and V)
            *before* writing the new tokens.
        new_blocks: every block this append took from the pool (CoW destinations included).
    """

    # Why frozen, with tuples: a plan is handed from the bookkeeping to the tensor side (and may
    # be queued for a later step); nothing along the way may change what was decided.
    seq_id: Hashable
    start: int
    slots: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    new_blocks: tuple[int, ...]

    @property
    def num_new_tokens(self) -> int:
        """Number of tokens the append added."""
        return len(self.slots)

    @property
    def end(self) -> int:
        """The sequence's length after the append (``start + num_new_tokens``)."""
        return self.start + len(self.slots)


class _Table:
    # Why a plain list of ids plus a token count: a table only grows at its end, and CoW only
    # ever replaces its last entry, so a list gives O(1) for both and is cheap to snapshot
    # when a batch's metadata is built. Invariant: len(blocks) == ceil(num_tokens / block_size).
    __slots__ = ("blocks", "num_tokens")

    def __init__(self, blocks: list[int], num_tokens: int) -> None:
        self.blocks = blocks
        self.num_tokens = num_tokens


class PagedKVAllocator:
    """Owns a :class:`BlockPool` and one block table per live sequence.

    Sequences are keyed by any hashable id. ``fork`` shares every block of the parent with the
    child by reference count; afterwards a sequence that appends into a *shared, partly filled*
    last block first gets a private copy of it (reported in :attr:`AppendPlan.copies`). Full
    shared blocks are never written again, so they stay shared until every holder is freed.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Create an allocator over ``num_blocks`` blocks of ``block_size`` tokens each.

        Raises:
            ValueError: either argument is not a positive int.
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._pool = BlockPool(num_blocks)
        self._block_size = block_size
        self._tables: dict[Hashable, _Table] = {}

    # ------------------------------------------------------------------ queries

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks at least one sequence holds."""
        return self._pool.num_used

    @property
    def pool(self) -> BlockPool:
        """The underlying pool, for inspection (reference counts); do not change it directly."""
        return self._pool

    def __len__(self) -> int:
        """Number of live sequences."""
        return len(self._tables)

    def seq_ids(self) -> list[Hashable]:
        """Ids of the live sequences, in the order they were added or forked."""
        return list(self._tables)

    def has(self, seq_id: Hashable) -> bool:
        """Return whether ``seq_id`` is a live sequence."""
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Return a copy of the sequence's block ids, in token order.

        Raises:
            EngineError: unknown ``seq_id``.
        """
        return list(self._table(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Return how many tokens the sequence holds.

        Raises:
            EngineError: unknown ``seq_id``.
        """
        return self._table(seq_id).num_tokens

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """Return how many free blocks ``append(seq_id, n)`` would take (CoW copy included).

        Raises:
            EngineError: unknown ``seq_id`` or negative ``n``.
        """
        self._check_n(n)
        table = self._table(seq_id)
        return self._needs(table, n, self._pool.refcount(table.blocks[-1]) if table.blocks else 0)

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        """Return whether ``append(seq_id, n)`` would succeed now.

        Raises:
            EngineError: unknown ``seq_id`` or negative ``n``.
        """
        return self._pool.can_allocate(self.blocks_needed(seq_id, n))

    def blocks_needed_batch(self, requests: Mapping[_K, int]) -> int:
        """Return how many free blocks ``append_batch(requests)`` would take, exactly.

        Appends run in the mapping's order, so when two forks of one block both append, only the
        first one copies (after it, the second holds the block alone).

        Raises:
            EngineError: an unknown id or a negative count.
        """
        pending_drops: dict[int, int] = {}
        total = 0
        for seq_id, n in requests.items():
            self._check_n(n)
            table = self._table(seq_id)
            last_refs = 0
            if table.blocks:
                last = table.blocks[-1]
                last_refs = self._pool.refcount(last) - pending_drops.get(last, 0)
                if self._cow_needed(table, n, last_refs):
                    pending_drops[last] = pending_drops.get(last, 0) + 1
            total += self._needs(table, n, last_refs)
        return total

    def can_append_batch(self, requests: Mapping[_K, int]) -> bool:
        """Return whether ``append_batch(requests)`` would succeed now.

        Raises:
            EngineError: an unknown id or a negative count.
        """
        return self._pool.can_allocate(self.blocks_needed_batch(requests))

    # ------------------------------------------------------------------ changes

    def add(self, seq_id: Hashable) -> None:
        """Start an empty sequence (it holds no block until it appends).

        Raises:
            EngineError: ``seq_id`` is already live.
        """
        if seq_id in self._tables:
            raise EngineError(f"sequence {seq_id!r} already exists")
        self._tables[seq_id] = _Table([], 0)

    def append(self, seq_id: Hashable, n: int) -> AppendPlan:
        """Make room for ``n`` more tokens and return where they go.

        Takes new blocks as needed; if the last block is partly filled and shared with a fork,
        takes a private copy of it first (in the plan's ``copies``). ``n == 0`` is a no-op plan.

        Raises:
            EngineError: unknown ``seq_id`` or negative ``n``.
            KVCacheFull: too few free blocks; nothing changed. The message names the sequence,
                the token count, the blocks needed and the blocks free.
        """
        needed = self.blocks_needed(seq_id, n)
        if not self._pool.can_allocate(needed):
            raise KVCacheFull(
                f"KV cache full: sequence {seq_id!r} needs {needed} block(s) for {n} more "
                f"token(s), {self._pool.num_free} of {self._pool.num_blocks} free"
            )
        return self._commit_append(seq_id, n, needed)

    def append_batch(self, requests: Mapping[_K, int]) -> list[AppendPlan]:
        """Append to several sequences at once, all or nothing; plans come in mapping order.

        Raises:
            EngineError: an unknown id or a negative count; nothing changed.
            KVCacheFull: the batch as a whole needs more blocks than are free; nothing changed.
        """
        needed = self.blocks_needed_batch(requests)
        if not self._pool.can_allocate(needed):
            raise KVCacheFull(
                f"KV cache full: batch of {len(requests)} sequence(s), "
                f"{sum(requests.values())} token(s) needs {needed} block(s), "
                f"{self._pool.num_free} of {self._pool.num_blocks} free"
            )
        return [self._commit_append(s, n, self.blocks_needed(s, n)) for s, n in requests.items()]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        Takes no free block (never raises KVCacheFull); copies happen lazily on append.

        Raises:
            EngineError: ``parent_id`` is unknown or ``child_id`` is already live.
        """
        parent = self._table(parent_id)
        if child_id in self._tables:
            raise EngineError(f"cannot fork into {child_id!r}: sequence already exists")
        self._pool.incref(parent.blocks)
        self._tables[child_id] = _Table(list(parent.blocks), parent.num_tokens)

    def truncate(self, seq_id: Hashable, n: int) -> int:
        """Keep the first ``n`` tokens of the sequence: its blocks past them lose one reference
        (a block still shared with another holder stays with it); return blocks released. A
        kept last block that is partly filled and shared is copied on the next append, as
        after a fork.

        Raises:
            EngineError: unknown ``seq_id``, or ``n`` negative or past its length.
        """
        self._check_n(n)
        table = self._table(seq_id)
        if n > table.num_tokens:
            raise EngineError(
                f"cannot truncate {seq_id!r} to {n} tokens: it holds {table.num_tokens}"
            )
        keep = -(-n // self._block_size)
        released = self._pool.decref(table.blocks[keep:])
        del table.blocks[keep:]
        table.num_tokens = n
        return len(released)

    def free(self, seq_id: Hashable) -> int:
        """Drop the sequence and one reference to each of its blocks; return blocks released.

        Used alike when a sequence finishes, fails or is cancelled.

        Raises:
            EngineError: unknown ``seq_id``.
        """
        table = self._table(seq_id)
        released = self._pool.decref(table.blocks)
        del self._tables[seq_id]
        return len(released)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert tables and pool agree: each block's refcount equals the tables holding it,
        each table has ``ceil(num_tokens / block_size)`` blocks, free + used == total.

        Raises:
            AssertionError: the bookkeeping is corrupt (a bug, never a usage error).
        """
        self._pool.check_invariants()
        holders = [0] * self._pool.num_blocks
        for seq_id, table in self._tables.items():
            want = -(-table.num_tokens // self._block_size)
            assert len(table.blocks) == want, (
                f"{seq_id!r}: {len(table.blocks)} blocks for {table.num_tokens} tokens"
            )
            assert len(set(table.blocks)) == len(table.blocks), f"{seq_id!r} repeats a block"
            for block in table.blocks:
                holders[block] += 1
        for block, count in enumerate(holders):
            refs = self._pool.refcount(block)
            assert refs == count, f"block {block}: refcount {refs}, held by {count} table(s)"
        assert self._pool.num_free + self._pool.num_used == self._pool.num_blocks

    # ------------------------------------------------------------------ internals

    def _table(self, seq_id: Hashable) -> _Table:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise EngineError(f"unknown sequence {seq_id!r}") from None

    @staticmethod
    def _check_n(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise EngineError(f"token count must be a non-negative int, got {n!r}")

    def _cow_needed(self, table: _Table, n: int, last_refs: int) -> bool:
        return n > 0 and table.num_tokens % self._block_size != 0 and last_refs > 1

    def _needs(self, table: _Table, n: int, last_refs: int) -> int:
        grow = -(-(table.num_tokens + n) // self._block_size) - len(table.blocks)
        return grow + (1 if self._cow_needed(table, n, last_refs) else 0)

    def _commit_append(self, seq_id: Hashable, n: int, needed: int) -> AppendPlan:
        # Callers have checked that ``needed`` blocks are free, so nothing below can fail.
        table = self._tables[seq_id]
        fresh = self._pool.allocate(needed)
        new_blocks = tuple(fresh)
        copies: tuple[tuple[int, int], ...] = ()
        if table.blocks and self._cow_needed(table, n, self._pool.refcount(table.blocks[-1])):
            src, dst = table.blocks[-1], fresh.pop(0)
            released = self._pool.decref([src])
            assert not released, f"CoW source block {src} was not shared"
            table.blocks[-1] = dst
            copies = ((src, dst),)
        table.blocks.extend(fresh)
        bs = self._block_size
        start = table.num_tokens
        blocks = table.blocks
        slots = tuple(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        table.num_tokens = start + n
        return AppendPlan(seq_id, start, slots, copies, new_blocks)
