"""FlashInfer backend against the torch backend and the dense float64 reference (CUDA only).

Tolerances: bf16/fp16 atol 2e-2 against the float64 reference and between the two backends.
Head shapes: GQA groups of 1, 2, 3 (SmolLM2's 9/3 heads at head_dim 64), 4 and 8, full MHA.
Skipped unless CUDA is available and ``flashinfer`` imports.
"""

from __future__ import annotations

import pytest
import torch

from mstar_async.engines.kv import (
    AttentionSpec,
    BatchLayout,
    FlashInferAttentionBackend,
    TorchAttentionBackend,
    select_attention_backend,
)
from mstar_async.errors import EngineError

from .kv_harness import World

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ATOL = 2e-2


@pytest.fixture(autouse=True)
def _needs_flashinfer() -> None:
    pytest.importorskip("flashinfer")


def world(dtype: torch.dtype, heads: tuple[int, int], head_dim: int = 128) -> World:
    spec = AttentionSpec(heads[0], heads[1], head_dim, dtype=dtype)
    return World(
        spec,
        FlashInferAttentionBackend(spec, "cuda"),
        num_blocks=37,
        block_size=16,
        device="cuda",
        twin=TorchAttentionBackend(spec, "cuda"),
    )


def check(w: World, requests: dict[str, int]) -> None:
    result = w.step(requests)
    assert result["err"] <= ATOL and result["twin_err"] <= ATOL, result


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [
        ((8, 2), 128),
        ((8, 1), 128),
        ((4, 4), 128),
        ((9, 3), 64),  # SmolLM2-135M: a GQA group of 3
        ((32, 8), 128),  # Llama-3-8B's shape
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_torch(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int
) -> None:
    w = world(dtype, heads, head_dim)
    for seq in "abcd":
        w.add(seq)
    check(w, {"a": 20, "b": 33, "c": 1, "d": 16})  # prefill only
    check(w, dict.fromkeys("abcd", 1))  # decode only
    check(w, {"a": 1, "b": 40, "c": 7, "d": 1})  # mixed, chunked prefill
    w.fork("a", "a2")  # a has 22 tokens: fork mid-block
    check(w, {"a": 1, "a2": 5, "b": 1})  # copy-on-write
    for _ in range(3):
        check(w, dict.fromkeys(["a", "a2", "b", "c", "d"], 1))


def test_stale_metadata_is_rejected() -> None:
    w = world(torch.bfloat16, (8, 2))
    w.add("a")
    check(w, {"a": 5})
    first = w.backend.plan(BatchLayout.from_allocator(w.alloc, [("a", 1)]))
    w.backend.plan(BatchLayout.from_allocator(w.alloc, [("a", 2)]))
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(EngineError, match="stale"):
        w.backend.forward(q, w.cache.key(0), w.cache.value(0), first)


def test_select_prefers_flashinfer_on_cuda() -> None:
    spec = AttentionSpec(8, 2, 128, dtype=torch.bfloat16)
    assert isinstance(select_attention_backend("cuda", spec), FlashInferAttentionBackend)
    odd = AttentionSpec(8, 2, 48, dtype=torch.bfloat16)
    assert isinstance(select_attention_backend("cuda", odd), TorchAttentionBackend)
