"""Torch paged-attention backend against a dense float64 reference.

Tolerances (max abs error against causal attention in float64 over each sequence's full,
contiguous K/V history; inputs are N(0, 1)):
    float32:  atol 1e-5   (observed ~3e-7)
    bfloat16: atol 2e-2   (observed ~7e-3; bf16 rounds outputs of magnitude ~1 by up to 4e-3)
Block tables are scrambled (random, non-contiguous ids), GQA is 4 query heads on 2 KV heads
unless a test says otherwise, and the pool has 37 blocks (not a power of two).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping
from typing import TypeVar

import pytest
import torch

from mstar_async.engines.kv import (
    AttentionSpec,
    BatchLayout,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    select_attention_backend,
)
from mstar_async.errors import EngineError

from .kv_harness import World

K = TypeVar("K", bound=Hashable)

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# 1.0: each prefill sequence gets its own SDPA call; inf: all prefills share one padded call.
PADDING = [pytest.param(1.0, id="per-seq"), pytest.param(math.inf, id="padded")]


def world(
    dtype: torch.dtype = torch.float32,
    pad: float = 2.0,
    *,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    scale: float | None = None,
    seed: int = 0,
) -> World:
    spec = AttentionSpec(heads[0], heads[1], head_dim, dtype=dtype, scale=scale)
    return World(spec, TorchAttentionBackend(spec, "cpu", pad_waste_limit=pad), seed=seed)


def check(w: World, requests: Mapping[K, int]) -> dict[str, float]:
    result = w.step(requests)
    assert result["err"] <= ATOL[w.spec.dtype], result
    return result


@pytest.mark.parametrize("pad", PADDING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_only(dtype: torch.dtype, pad: float) -> None:
    w = world(dtype, pad)
    for seq in "abcd":
        w.add(seq)
    result = check(w, {"a": 5, "b": 9, "c": 1, "d": 4})
    # "c" (one token) is a decode-shaped row; the others are prefills.
    assert result["groups"] == (2 if pad == math.inf else 4)
    tables = [w.alloc.block_table(s) for s in "abd"]
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_fresh_prefill_uses_plain_causal(dtype: torch.dtype) -> None:
    w = world(dtype)
    w.add("a")
    check(w, {"a": 11})
    w.add("b")
    layout = BatchLayout.from_plans(w.alloc, w.alloc.append_batch({"b": 6}))
    meta = w.backend.plan(layout)
    assert isinstance(meta, TorchAttentionMetadata)
    (group,) = meta.groups
    assert group.is_causal and group.mask is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_only_is_one_padded_call(dtype: torch.dtype) -> None:
    w = world(dtype)
    lengths = {"a": 3, "b": 8, "c": 13, "d": 1}
    for seq in lengths:
        w.add(seq)
    check(w, lengths)
    for _ in range(3):
        result = check(w, dict.fromkeys(lengths, 1))
        assert result["groups"] == 1


def test_decode_with_equal_contexts_needs_no_mask() -> None:
    w = world()
    for seq in "ab":
        w.add(seq)
    check(w, {"a": 6, "b": 6})
    layout = BatchLayout.from_plans(w.alloc, w.alloc.append_batch({"a": 1, "b": 1}))
    meta = w.backend.plan(layout)
    assert isinstance(meta, TorchAttentionMetadata)
    (group,) = meta.groups
    assert group.mask is None and group.q_rows is None and group.out_rows is None


@pytest.mark.parametrize("pad", PADDING)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_chunked_prefill(dtype: torch.dtype, pad: float) -> None:
    w = world(dtype, pad)
    for seq in "abcd":
        w.add(seq)
    check(w, {"a": 7, "b": 3, "d": 2})
    # decode, chunked prefill (3 cached + 6 new), fresh prefill, decode, in one batch:
    check(w, {"a": 1, "b": 6, "c": 5, "d": 1})
    # another chunk of b and c next to decodes, in a different batch order
    check(w, {"c": 4, "d": 1, "b": 2, "a": 1})
    check(w, dict.fromkeys("abcd", 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_forked_branches_share_prefix_and_copy_on_write(dtype: torch.dtype) -> None:
    w = world(dtype)
    w.add("root")
    check(w, {"root": 6})  # block size 4: one full block plus a half-filled one
    w.fork("root", "x")
    w.fork("root", "y")
    shared = w.alloc.block_table("root")
    plans_before = w.alloc.num_free_blocks
    check(w, {"x": 3, "y": 1, "root": 2})  # x and y each copy the half block; root keeps it
    assert w.alloc.num_free_blocks == plans_before - 3  # two copies + x's extra block
    assert w.alloc.block_table("root") == shared
    assert w.alloc.block_table("x")[0] == w.alloc.block_table("y")[0] == shared[0]
    for _ in range(2):
        check(w, {"root": 1, "x": 1, "y": 1})
    w.fork("x", "x2")  # x has 11 tokens: fork mid-block again, then diverge
    check(w, {"x2": 5, "x": 1})
    w.free("root")
    check(w, {"x": 1, "x2": 1, "y": 2})


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((4, 4), 16), ((8, 2), 16), ((6, 3), 16), ((3, 1), 16), ((9, 3), 64), ((32, 8), 128)],
)
def test_gqa_ratios(heads: tuple[int, int], head_dim: int) -> None:
    w = world(heads=heads, head_dim=head_dim)
    for seq in "abc":
        w.add(seq)
    check(w, {"a": 6, "b": 2})
    check(w, {"a": 1, "b": 4, "c": 3})
    check(w, dict.fromkeys("abc", 1))


def test_scale_override() -> None:
    w = world(scale=0.05)
    assert w.spec.softmax_scale == 0.05
    for seq in "ab":
        w.add(seq)
    check(w, {"a": 5, "b": 2})
    check(w, {"a": 1, "b": 3})


@pytest.mark.parametrize("seed", range(4))
def test_random_traces(seed: int) -> None:
    """Random adds, forks, frees and mixed steps; every step checked against the reference.

    Even seeds run float32, odd seeds bfloat16; when a batch does not fit, a sequence is freed.
    """
    rng = random.Random(seed)
    dtype = torch.float32 if seed % 2 == 0 else torch.bfloat16
    w = world(dtype, pad=rng.choice([1.0, 2.0, math.inf]), seed=seed)
    names = iter(f"s{i}" for i in range(1000))
    steps = 0
    for _ in range(30):
        live = list(w.history)
        op = rng.random()
        if not live or op < 0.2:
            w.add(next(names))
        elif op < 0.35:
            w.fork(rng.choice(live), next(names))
        elif op < 0.45 and len(live) > 1:
            w.free(rng.choice(live))
        live = list(w.history)
        chosen = rng.sample(live, rng.randint(1, len(live)))
        requests = {s: rng.choice([1, 1, 2, 5]) for s in chosen}
        if w.alloc.can_append_batch(requests):
            check(w, requests)
            steps += 1
        else:
            w.free(rng.choice(live))
    assert steps >= 15


def test_forward_rejects_misuse() -> None:
    w = world()
    w.add("a")
    check(w, {"a": 3})
    layout = BatchLayout.from_plans(w.alloc, w.alloc.append_batch({"a": 2}))
    meta = w.backend.plan(layout)
    k, v = w.cache.key(0), w.cache.value(0)
    q = torch.zeros(2, 4, 16)
    other = TorchAttentionBackend(w.spec, "cpu")
    with pytest.raises(EngineError, match="not planned by this"):
        other.forward(q, k, v, meta)
    with pytest.raises(EngineError, match="q has shape"):
        w.backend.forward(torch.zeros(3, 4, 16), k, v, meta)
    with pytest.raises(EngineError, match="dtype"):
        w.backend.forward(q.to(torch.bfloat16), k, v, meta)
    with pytest.raises(EngineError, match="k_cache"):
        w.backend.forward(q, k[:, :2], v, meta)
    with pytest.raises(EngineError, match="contiguous"):
        w.backend.forward(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, meta)
    assert w.backend.forward(q, k, v, meta).shape == q.shape


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="multiple"):
        AttentionSpec(6, 4, 16)
    with pytest.raises(ValueError, match="head_dim"):
        AttentionSpec(4, 2, 0)
    assert AttentionSpec(4, 2, 64).softmax_scale == 1 / 8


def test_select_backend_on_cpu_is_torch() -> None:
    spec = AttentionSpec(4, 2, 64, dtype=torch.bfloat16)
    assert isinstance(select_attention_backend("cpu", spec), TorchAttentionBackend)
    assert isinstance(select_attention_backend("cpu", spec, prefer="torch"), TorchAttentionBackend)
    with pytest.raises(EngineError, match="not CUDA"):
        select_attention_backend("cpu", spec, prefer="flashinfer")
    with pytest.raises(ValueError, match="pad_waste_limit"):
        TorchAttentionBackend(spec, "cpu", pad_waste_limit=0.5)
