"""PagedKVCache: layout, writes at flat slots, copy-on-write block copies, budgets."""

from __future__ import annotations

import pytest
import torch

from mstar_async.engines.kv import PagedKVCache, bytes_per_block
from mstar_async.errors import EngineError


def make(dtype: torch.dtype = torch.float32) -> PagedKVCache:
    return PagedKVCache(
        num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3, dtype=dtype
    )


def test_views_are_contiguous_nhd() -> None:
    cache = make()
    assert cache.kv.shape == (3, 2, 5, 4, 2, 3)
    k, v = cache.key(1), cache.value(1)
    assert k.shape == v.shape == (5, 4, 2, 3)
    assert k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() != v.data_ptr()


def test_write_puts_tokens_at_flat_slots() -> None:
    cache = make()
    k = torch.randn(3, 2, 3)
    v = torch.randn(3, 2, 3)
    slots = torch.tensor([0, 7, 18])  # block 0 off 0, block 1 off 3, block 4 off 2
    cache.write(2, slots, k, v)
    key = cache.key(2)
    for i, (block, off) in enumerate([(0, 0), (1, 3), (4, 2)]):
        assert torch.equal(key[block, off], k[i])
        assert torch.equal(cache.value(2)[block, off], v[i])
    assert cache.kv[:2].abs().sum() == 0  # other layers untouched


def test_write_casts_to_cache_dtype() -> None:
    cache = make(torch.bfloat16)
    k = torch.randn(1, 2, 3)
    cache.write(0, torch.tensor([5]), k, k)
    assert torch.equal(cache.key(0)[1, 1], k[0].to(torch.bfloat16))


def test_copy_blocks_copies_every_layer_k_and_v() -> None:
    cache = make()
    cache.kv.normal_()
    before = cache.kv.clone()
    cache.copy_blocks([(1, 3), (4, 0)])
    assert torch.equal(cache.kv[:, :, 3], before[:, :, 1])
    assert torch.equal(cache.kv[:, :, 0], before[:, :, 4])
    for untouched in (1, 2, 4):
        assert torch.equal(cache.kv[:, :, untouched], before[:, :, untouched])
    cache.copy_blocks([])


def test_copy_blocks_rejects_bad_pairs() -> None:
    cache = make()
    with pytest.raises(EngineError, match="distinct"):
        cache.copy_blocks([(0, 1), (2, 1)])
    with pytest.raises(EngineError, match="distinct"):
        cache.copy_blocks([(0, 1), (1, 2)])
    with pytest.raises(EngineError, match="out of range"):
        cache.copy_blocks([(0, 5)])


def test_write_rejects_bad_inputs() -> None:
    cache = make()
    k = torch.zeros(2, 2, 3)
    with pytest.raises(EngineError, match="shape|expects"):
        cache.write(0, torch.tensor([0, 1]), torch.zeros(2, 2, 4), k)
    with pytest.raises(EngineError, match="int64"):
        cache.write(0, torch.tensor([0, 1], dtype=torch.int32), k, k)
    with pytest.raises(EngineError, match="layer 3"):
        cache.write(3, torch.tensor([0, 1]), k, k)


def test_from_budget_fits_the_budget() -> None:
    per = bytes_per_block(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype_bytes=2)
    cache = PagedKVCache.from_budget(
        per * 7 + 5, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16
    )
    assert cache.num_blocks == 7 and cache.nbytes == per * 7
    with pytest.raises(ValueError, match="fits no block"):
        PagedKVCache.from_budget(
            per - 1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16
        )
