"""Moving one sequence's keys and values out of a paged cache and into another (a request that
prefills on one rank and decodes on another)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from mstar_async.errors import KVCacheFull

from .allocator import PagedKVAllocator
from .cache import PagedKVCache

__all__ = ["read_sequence", "write_sequence"]


def read_sequence(allocator: PagedKVAllocator, cache: PagedKVCache, seq: Hashable) -> torch.Tensor:
    """The sequence's K/V on the CPU, ``[layers, 2, tokens, kv_heads, head_dim]``.

    Raises:
        EngineError: the allocator holds no such sequence.
    """
    n = allocator.num_tokens(seq)
    blocks = torch.tensor(allocator.block_table(seq), dtype=torch.int64, device=cache.device)
    # [layers, 2, blocks, block_size, heads, dim] -> the sequence's tokens in order.
    picked = cache.kv.index_select(2, blocks).flatten(2, 3)[:, :, :n]
    return picked.cpu()


def write_sequence(
    allocator: PagedKVAllocator, cache: PagedKVCache, seq: Hashable, kv: torch.Tensor
) -> None:
    """Start ``seq`` holding ``kv`` (as ``read_sequence`` gave it): allocate and write.

    Raises:
        KVCacheFull: too few free blocks; nothing changed.
        EngineError: ``seq`` is already live.
    """
    n = int(kv.shape[2])
    needed = -(-n // allocator.block_size)
    if needed > allocator.num_free_blocks:
        raise KVCacheFull(
            f"no room for the {n} KV tokens of sequence {seq!r}: {needed} blocks needed, "
            f"{allocator.num_free_blocks} free"
        )
    allocator.add(seq)
    plan = allocator.append(seq, n)
    slots = torch.tensor(plan.slots, dtype=torch.int64, device=cache.device)
    kv = kv.to(cache.device, cache.dtype)
    for layer in range(cache.num_layers):
        cache.write(layer, slots, kv[layer, 0], kv[layer, 1])
