"""A fixed pool of KV-cache block ids with reference counts (pure Python, no torch).

The pool knows nothing about sequences or tensors: it hands out integer block ids
``0 .. num_blocks - 1``, counts how many owners hold each one, and takes a block back when its
count reaches zero. :class:`~mstar_async.engines.kv.allocator.PagedKVAllocator` builds
per-sequence block tables on top of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from mstar_async.errors import EngineError, KVCacheFull

__all__ = ["BlockPool"]


class BlockPool:
    """Hands out block ids from a fixed set and reference-counts them.

    Why a LIFO free list: ``allocate`` pops from the end of a Python list and ``decref`` pushes
    back onto it, both O(1). The most recently freed block is reused first, so its memory is the
    likeliest to still sit in the accelerator's L2 cache, and a short-lived sequence (a cancelled
    request, a CFG branch) keeps recycling the same few blocks instead of touching the whole pool.
    FIFO order would only pay off for a prefix cache that wants least-recently-freed eviction,
    which this pool does not do. The list starts reversed so a fresh pool hands out 0, 1, 2, ...
    (deterministic ids make tests and logs readable).

    A block is free exactly when its reference count is 0; the free list holds each free block
    once. Every method checks all its arguments before it changes anything, so a call that
    raises leaves the pool as it was.
    """

    def __init__(self, num_blocks: int) -> None:
        """Create a pool of ``num_blocks`` free blocks.

        Raises:
            ValueError: ``num_blocks`` is not a positive int.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._refcount: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        """Total number of blocks in the pool."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Number of blocks with reference count 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of blocks held by at least one owner."""
        return self._num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Return whether ``allocate(n)`` would succeed now.

        Raises:
            EngineError: ``n`` is negative.
        """
        self._check_count(n)
        return n <= len(self._free)

    def refcount(self, block_id: int) -> int:
        """Return how many owners hold ``block_id`` (0 when it is free).

        Raises:
            EngineError: ``block_id`` is not a block of this pool.
        """
        self._check_id(block_id)
        return self._refcount[block_id]

    def is_free(self, block_id: int) -> bool:
        """Return whether ``block_id`` is on the free list.

        Raises:
            EngineError: ``block_id`` is not a block of this pool.
        """
        return self.refcount(block_id) == 0

    def free_blocks(self) -> list[int]:
        """Return a copy of the free list, next block to be handed out last."""
        return list(self._free)

    # ------------------------------------------------------------------ changes

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1, and return their ids.

        All or nothing: when fewer than ``n`` blocks are free nothing is taken.

        Raises:
            EngineError: ``n`` is negative.
            KVCacheFull: fewer than ``n`` blocks are free; the message gives both numbers.
        """
        self._check_count(n)
        if n > len(self._free):
            raise KVCacheFull(
                f"KV cache full: asked for {n} block(s), {len(self._free)} of "
                f"{self._num_blocks} free"
            )
        taken: list[int] = []
        for _ in range(n):
            block = self._free.pop()
            assert self._refcount[block] == 0, f"block {block} on the free list is referenced"
            self._refcount[block] = 1
            taken.append(block)
        return taken

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each id in ``block_ids`` (an id listed twice gains two).

        Raises:
            EngineError: an id is unknown or free (only a held block can be shared); nothing
                changes in that case.
        """
        ids = list(block_ids)
        for block in ids:
            self._check_id(block)
            if self._refcount[block] == 0:
                raise EngineError(f"incref of free block {block}: only held blocks can be shared")
        for block in ids:
            self._refcount[block] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each id in ``block_ids``; return the ids that became free.

        A block whose count reaches 0 goes back on the free list.

        Raises:
            EngineError: an id is unknown, or would drop below zero (already free, or listed
                more times than it is held); nothing changes in that case.
        """
        counts = Counter(block_ids)
        for block, times in counts.items():
            self._check_id(block)
            if self._refcount[block] < times:
                state = "free" if self._refcount[block] == 0 else "held fewer times"
                raise EngineError(
                    f"decref of block {block} x{times}, but it has refcount "
                    f"{self._refcount[block]} ({state})"
                )
        released: list[int] = []
        for block, times in counts.items():
            self._refcount[block] -= times
            if self._refcount[block] == 0:
                released.append(block)
        # Push in reverse so a table freed as [a, b, c] is handed out again as a, b, c.
        for block in reversed(released):
            assert self._refcount[block] == 0, f"freed block {block} still has references"
            self._free.append(block)
        return released

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Same as :meth:`decref`: the owner gives its blocks back.

        Raises:
            EngineError: as :meth:`decref`.
        """
        return self.decref(block_ids)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert the pool is self-consistent: free list == blocks with count 0, no duplicates.

        Raises:
            AssertionError: the pool's bookkeeping is corrupt (a bug, never a usage error).
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block is on the free list twice"
        zero = {b for b, c in enumerate(self._refcount) if c == 0}
        assert free_set == zero, f"free list {sorted(free_set)} != unreferenced {sorted(zero)}"
        assert all(c >= 0 for c in self._refcount), "negative reference count"

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise EngineError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._num_blocks:
            raise EngineError(f"block id {block_id} out of range 0..{self._num_blocks - 1}")

    @staticmethod
    def _check_count(n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise EngineError(f"block count must be a non-negative int, got {n!r}")
