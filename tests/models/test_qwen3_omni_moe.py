"""The MoE layer's routed experts, batched: parity with the per-expert loop they replaced, and a
forward whose operations do not depend on which experts are picked (no host sync, no loop)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mstar_async.bench.moe import SHAPES, expert_loop
from mstar_async.models.qwen3_omni.config import SIZES
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, SparseMoE

pytestmark = pytest.mark.timeout(30)

#: Qwen3-Omni's routing (128 experts, top-8), narrow enough for a quick test.
OMNI = replace(SHAPES["omni"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32)

# Operations whose result size a host must read: unique, nonzero, one-argument torch.where,
# .item() (the loop's .tolist() reads the unique experts without dispatching anything).
HOST_SYNCS = ("aten._unique", "aten.nonzero", "aten.where.default", "aten._local_scalar_dense")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread (two on a shared 2-core machine spin-wait)."""


@functools.cache
def _layer(cfg: Qwen3Config, seed: int) -> SparseMoE:
    layer = SparseMoE(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return layer


def _routed(layer: SparseMoE, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(
        tokens, layer.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(seed)
    )
    weights, experts = layer.gate(x)
    return x, weights, experts


def _loop(layer: SparseMoE, x: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return expert_loop(layer.experts.gate_up_proj, layer.experts.down_proj, x, w, e)


@pytest.mark.parametrize("tokens", [1, 32, 512])
@pytest.mark.parametrize(
    "cfg",
    [SIZES["tiny"].thinker, SIZES["small"].talker, OMNI],
    ids=["tiny-thinker", "small-talker", "omni-routing"],
)
def test_batched_experts_equal_the_loop(cfg: Qwen3Config, tokens: int) -> None:
    layer = _layer(cfg, 0)
    x, weights, experts = _routed(layer, tokens, 1)
    with torch.inference_mode():
        got = layer.experts(x, weights, experts)
        want = _loop(layer, x, weights, experts)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.abs().max() > 0.1  # the experts did something


def test_skewed_routing_and_unpicked_experts() -> None:
    layer = _layer(SIZES["tiny"].thinker, 2)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    experts = torch.tensor([[3, 1]] * 8 + [[1, 2]])  # expert 0 unpicked, 1 picked by all
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got = layer.experts(x, weights, experts)
        torch.testing.assert_close(got, _loop(layer, x, weights, experts), atol=1e-5, rtol=1e-5)
        assert layer.experts(x[:0], weights[:0], experts[:0]).shape == (0, 64)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(run: Callable[[], torch.Tensor]) -> list[str]:
    with torch.inference_mode(), _Recorder() as recorder:
        run()
    return recorder.ops


def test_the_forward_is_the_same_operations_whichever_experts_are_picked() -> None:
    layer = _layer(OMNI, 0)
    x = torch.randn(16, OMNI.hidden_size, generator=torch.Generator().manual_seed(6))
    weights = torch.full((16, 8), 1 / 8)
    few = torch.arange(8).repeat(16, 1)  # 8 experts in all
    many = torch.arange(128).reshape(16, 8)  # every expert
    batched = [_ops(lambda e=e: layer.experts(x, weights, e)) for e in (few, many)]
    assert batched[0] == batched[1]
    assert not [op for op in batched[0] if any(sync in op for sync in HOST_SYNCS)]
    # The loop it replaced syncs once per picked expert (the recorder sees the difference).
    looped = [_ops(lambda e=e: _loop(layer, x, weights, e)) for e in (few, many)]
    assert [ops.count("aten.where.default") for ops in looped] == [8, 128]


def test_expert_sizes_must_suit_grouped_matmuls() -> None:
    with pytest.raises(ValueError, match="multiples of 8"):
        replace(SIZES["tiny"].thinker, moe_intermediate_size=36)
