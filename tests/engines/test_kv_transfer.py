"""A sequence's keys and values out of one paged cache and into another: whole blocks when the
block sizes agree, token rows when they do not; the same values either way."""

from __future__ import annotations

import pytest
import torch

from mstar_async.engines.kv.allocator import PagedKVAllocator
from mstar_async.engines.kv.cache import PagedKVCache
from mstar_async.engines.kv.transfer import read_sequence, write_sequence
from mstar_async.errors import KVCacheFull

LAYERS, HEADS, DIM = 2, 2, 4


def paged(blocks: int, block_size: int) -> tuple[PagedKVAllocator, PagedKVCache]:
    cache = PagedKVCache(
        num_layers=LAYERS,
        num_blocks=blocks,
        block_size=block_size,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=torch.float32,
    )
    return PagedKVAllocator(blocks, block_size), cache


def rows_of(allocator: PagedKVAllocator, cache: PagedKVCache, seq: str) -> torch.Tensor:
    """The sequence's rows, ``[layers, 2, tokens, heads, dim]``, read slot by slot."""
    n, size = allocator.num_tokens(seq), allocator.block_size
    table = allocator.block_table(seq)
    slots = [table[t // size] * size + t % size for t in range(n)]
    flat = cache.kv.view(LAYERS, 2, -1, HEADS, DIM)
    return flat[:, :, slots]


@pytest.mark.parametrize("target_block_size", [4, 8], ids=["same-blocks", "other-blocks"])
def test_a_sequence_arrives_with_the_same_values(target_block_size: int) -> None:
    source_alloc, source = paged(8, 4)
    source_alloc.add("other")  # so that the sequence's blocks are not the first ones
    source_alloc.append("other", 3)
    source_alloc.add("a")
    plan = source_alloc.append("a", 10)  # two full blocks and half of a third
    slots = torch.tensor(plan.slots)
    for layer in range(LAYERS):
        k, v = torch.randn(10, HEADS, DIM), torch.randn(10, HEADS, DIM)
        source.write(layer, slots, k, v)
    moved = read_sequence(source_alloc, source, "a")
    assert moved.tokens == 10 and moved.blocks.is_contiguous()
    assert tuple(moved.blocks.shape) == (LAYERS, 2, 3, 4, HEADS, DIM)

    target_alloc, target = paged(6, target_block_size)
    target_alloc.add("b")
    target_alloc.append("b", 5)
    write_sequence(target_alloc, target, "a", moved)
    assert target_alloc.num_tokens("a") == 10
    assert torch.equal(rows_of(target_alloc, target, "a"), rows_of(source_alloc, source, "a"))


def test_a_sequence_without_room_changes_nothing() -> None:
    source_alloc, source = paged(8, 4)
    source_alloc.add("a")
    source_alloc.append("a", 12)
    target_alloc, target = paged(2, 4)
    with pytest.raises(KVCacheFull, match="3 blocks needed, 2 free"):
        write_sequence(target_alloc, target, "a", read_sequence(source_alloc, source, "a"))
    assert not target_alloc.has("a") and target_alloc.num_free_blocks == 2
