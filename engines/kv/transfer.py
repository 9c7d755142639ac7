"""Moving one sequence's keys and values out of a paged cache and into another (a request that
prefills on one rank and decodes on another).

The sequence travels as whole blocks, as the cache holds them: one ``index_select`` out (a
contiguous tensor, which the transport sends without another copy) and one ``index_copy_`` in.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from mstar_async.errors import KVCacheFull

from .allocator import PagedKVAllocator
from .cache import PagedKVCache

__all__ = ["SequenceKV", "read_sequence", "write_sequence"]


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's keys and values: its blocks in order, ``[layers, 2, blocks, block_size,
    kv_heads, head_dim]`` (contiguous, on the CPU), whose first ``tokens`` token rows are the
    sequence's."""

    blocks: torch.Tensor
    tokens: int


def read_sequence(allocator: PagedKVAllocator, cache: PagedKVCache, seq: Hashable) -> SequenceKV:
    """The sequence's K/V as whole blocks, copied out of the cache. Never raises for a
    sequence the allocator holds.

    Raises:
        EngineError: the allocator holds no such sequence.
    """
    n = allocator.num_tokens(seq)
    blocks = torch.tensor(allocator.block_table(seq), dtype=torch.int64, device=cache.device)
    return SequenceKV(cache.kv.index_select(2, blocks).cpu(), n)


def write_sequence(
    allocator: PagedKVAllocator, cache: PagedKVCache, seq: Hashable, kv: SequenceKV
) -> None:
    """Start ``seq`` holding ``kv`` (as ``read_sequence`` gave it): allocate and write.

    Raises:
        KVCacheFull: too few free blocks; nothing changed.
        EngineError: ``seq`` is already live.
    """
    n = kv.tokens
    needed = -(-n // allocator.block_size)
    if needed > allocator.num_free_blocks:
        raise KVCacheFull(
            f"no room for the {n} KV tokens of sequence {seq!r}: {needed} blocks needed, "
            f"{allocator.num_free_blocks} free"
        )
    allocator.add(seq)
    plan = allocator.append(seq, n)
    values = kv.blocks.to(cache.device, cache.dtype)
    if values.shape[3] == allocator.block_size:
        # Same block size on both ranks: whole blocks, every layer, K and V, in one copy (the
        # last block's rows past the sequence's end are free slots, written again when used).
        table = allocator.block_table(seq)[:needed]
        index = torch.tensor(table, dtype=torch.int64, device=cache.device)
        cache.kv.index_copy_(2, index, values[:, :, :needed])
        return
    rows = values.flatten(2, 3)[:, :, :n]
    slots = torch.tensor(plan.slots, dtype=torch.int64, device=cache.device)
    for layer in range(cache.num_layers):
        cache.write(layer, slots, rows[layer, 0], rows[layer, 1])
