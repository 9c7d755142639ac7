"""``QuantLinear`` against the float matmul it stands for, and the check for missing kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mstar_async.errors import QuantizationUnsupported
from mstar_async.models.quant import (
    KERNELS,
    QuantizedWeight,
    QuantLinear,
    missing_kernels,
    quantize_int4,
    quantize_int8,
    require_kernels,
)

QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


def _data(rows: int, cols: int, batch: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * cols)
    return torch.randn(rows, cols, generator=gen) / cols**0.5, torch.randn(
        batch, cols, generator=gen
    )


def _weights_of(layer: QuantLinear, cols: int) -> torch.Tensor:
    """The weight the kernel multiplies by, read back through an identity matrix (each output
    is then one weight times 1 plus zeros: exact in float32)."""
    return layer(torch.eye(cols, dtype=torch.float32)).t()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float32_kernels_multiply_by_exactly_the_dequantized_weights(scheme: str) -> None:
    w, x = _data(96, 128)
    q = QUANTIZERS[scheme](w)
    layer = QuantLinear(q, None, dtype=torch.float32)
    # int8: code * scale, one product: exact. int4: (code - 8) * scale + (offset + 8 * scale)
    # with an arbitrary float32 offset: the zero rounds once, so within an ulp of the weight.
    got = _weights_of(layer, 128)
    if scheme == "int8":
        assert torch.equal(got, q.dequantize())
    else:
        assert torch.allclose(got, q.dequantize(), rtol=0, atol=2e-7)
    assert torch.allclose(layer(x), F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_bfloat16_output_is_within_the_quantization_bound_of_the_float_matmul(
    scheme: str,
) -> None:
    w, x = _data(96, 128)
    q = QUANTIZERS[scheme](w)
    layer = QuantLinear(q, None, dtype=torch.bfloat16)
    exact = F.linear(x.double(), w.double())
    # Each weight is off by at most half a step; a step is its row's (int8) or group's (int4)
    # scale; then the bfloat16 rounding of the scales and of the output (2^-8 relative).
    step = q.scales.repeat_interleave(q.group_size, dim=1).double()
    bound = x.double().abs() @ (step / 2 + step * 16 / 256).t() + exact.abs() / 128
    error = (layer(x.bfloat16()).double() - exact).abs()
    assert torch.all(error <= bound)
    # ... and far from vacuous: the typical error is a small part of the bound.
    assert error.mean() < 0.5 * bound.mean()


def test_rows_are_padded_for_the_int4_packing_and_cut_from_the_output() -> None:
    w, x = _data(40, 64)  # 40 rows: not a multiple of the packing's 16
    q = quantize_int4(w)
    layer = QuantLinear(q, None, dtype=torch.float32)
    assert layer.packed.shape[0] == 48
    y = layer(x)
    assert y.shape == (5, 40)
    assert torch.allclose(y, F.linear(x, q.dequantize()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_bias_and_leading_dimensions(scheme: str) -> None:
    w, x = _data(32, 64, batch=6)
    bias = torch.linspace(-1, 1, 32)
    q = QUANTIZERS[scheme](w)
    layer = QuantLinear(q, bias, dtype=torch.float32)
    y = layer(x.reshape(2, 3, 64))
    assert y.shape == (2, 3, 32)
    want = F.linear(x, q.dequantize(), bias).reshape(2, 3, 32)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)


def test_symmetric_4_bit_codes_multiply_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-8, 8, (16, 64), generator=gen, dtype=torch.int8)
    # float16-representable scales, as GGUF's Q4_0 stores them.
    scales = (torch.rand(16, 2, generator=gen) - 0.5).half().float()
    q = QuantizedWeight(codes, scales, None, 4, 32)
    layer = QuantLinear(q, None, dtype=torch.float32)
    assert torch.equal(_weights_of(layer, 64), q.dequantize())


def test_layouts_no_kernel_takes_are_refused() -> None:
    q = QuantizedWeight(torch.zeros(16, 128, dtype=torch.int8), torch.ones(16, 2), None, 8, 64)
    with pytest.raises(ValueError, match="fits no kernel"):
        QuantLinear(q, None, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        QuantLinear(quantize_int8(torch.ones(16, 64)), None, dtype=torch.float64)


def test_this_cpu_build_has_every_kernel() -> None:
    for scheme in KERNELS:
        assert missing_kernels(scheme, "cpu") == []
        require_kernels(scheme, "cpu")


def test_a_device_without_the_kernels_is_refused_naming_them(monkeypatch: Any) -> None:
    real = torch._C._dispatch_has_kernel_for_dispatch_key

    def has_kernel(op: str, key: str) -> bool:
        return False if key == "CUDA" else bool(real(op, key))

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", has_kernel)
    assert missing_kernels("int4", "cuda") == list(KERNELS["int4"])
    with pytest.raises(QuantizationUnsupported) as caught:
        QuantLinear(quantize_int4(torch.ones(16, 64)), None, dtype=torch.bfloat16, device="cuda")
    message = str(caught.value)
    assert "torch.ops.aten._weight_int4pack_mm_for_cpu" in message
    assert "torch.ops.aten._convert_weight_to_int4pack_for_cpu" in message
    assert "'cuda'" in message and torch.__version__ in message
    # A device type no backend has registered kernels for lacks them too.
    assert missing_kernels("int8", "privateuseone") == ["_weight_int8pack_mm"]
