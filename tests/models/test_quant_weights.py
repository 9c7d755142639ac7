"""Quantized weights: the error bounds of int8 / int4 quantization and what ``fit`` keeps."""

from __future__ import annotations

import pytest
import torch

from mstar_async.models.quant import (
    INT4_GROUP_SIZE,
    QuantizedWeight,
    fit,
    quantize_int4,
    quantize_int8,
)


def _weight(rows: int = 48, cols: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so a shared scale would show.
    return torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows).unsqueeze(1)


def test_int8_error_is_at_most_half_a_step_per_row() -> None:
    w = _weight()
    q = quantize_int8(w)
    assert q.bits == 8 and q.group_size == w.shape[1] and q.offsets is None
    assert q.codes.abs().max() == 127  # every row's largest weight maps to +-127
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((q.dequantize() - w).abs() <= step / 2 + 1e-6 * step)
    assert torch.allclose(q.scales, step)


def test_int4_error_is_at_most_half_a_step_per_group() -> None:
    w = _weight()
    q = quantize_int4(w)
    assert q.bits == 4 and q.group_size == INT4_GROUP_SIZE and q.offsets is not None
    assert int(q.codes.min()) == 0 and int(q.codes.max()) == 15
    groups = w.reshape(w.shape[0], -1, INT4_GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (q.dequantize() - w).reshape(groups.shape).abs()
    assert torch.all(error <= step.unsqueeze(-1) * (0.5 + 1e-5))
    # Each group's minimum is its offset, reproduced exactly by code 0.
    assert torch.equal(q.offsets, groups.amin(-1))


def test_constant_rows_and_groups_quantize_to_zero_scales() -> None:
    w = torch.zeros(16, 64)
    w[1] = 3.0
    q8, q4 = quantize_int8(w), quantize_int4(w)
    assert torch.equal(q8.dequantize()[0], torch.zeros(64))
    assert torch.equal(q4.dequantize(), w)
    assert torch.equal(q4.scales, torch.zeros(16, 2))


def test_fit_keeps_4_bit_blocks_and_requantizes_others() -> None:
    w = _weight()
    q4 = quantize_int4(w)
    assert fit(q4, "int4") is q4  # already in the int4 layout: kept as it is
    # Q8_0-like: 8-bit codes with a scale per 32 columns go to one scale per row.
    blocks = QuantizedWeight(
        torch.randint(-127, 128, (8, 64), dtype=torch.int8),
        torch.rand(8, 2) + 0.5,
        None,
        8,
        32,
    )
    per_row = fit(blocks, "int8")
    assert per_row.group_size == 64 and per_row.scales.shape == (8, 1)
    exact = blocks.dequantize()
    assert torch.all((per_row.dequantize() - exact).abs() <= per_row.scales / 2 + 1e-6)
    kept = quantize_int8(w)
    assert fit(kept, "int8") is kept
    assert fit(q4, "int8").bits == 8  # 4-bit blocks requantized for int8


def test_symmetric_4_bit_codes_dequantize_without_offsets() -> None:
    codes = torch.tensor([[-8, 7] * 16], dtype=torch.int8)
    q = QuantizedWeight(codes, torch.tensor([[0.5]]), None, 4, 32)
    assert q.dequantize()[0, :2].tolist() == [-4.0, 3.5]


def test_cat_and_map_rows() -> None:
    a, b = quantize_int4(_weight(16, 64, 1)), quantize_int4(_weight(32, 64, 2))
    both = QuantizedWeight.cat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    flipped = both.map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), both.dequantize().flip(0))
    with pytest.raises(ValueError, match="same columns"):
        QuantizedWeight.cat([a, quantize_int8(_weight(16, 64))])


def test_symmetric_and_affine_4_bit_rows_join_as_affine_codes() -> None:
    gen = torch.Generator().manual_seed(4)
    symmetric = QuantizedWeight(
        torch.randint(-8, 8, (16, 64), generator=gen, dtype=torch.int8),
        (torch.rand(16, 2, generator=gen) + 0.1).half().float(),
        None,
        4,
        32,
    )
    affine = quantize_int4(_weight(16, 64, 3))
    both = QuantizedWeight.cat([symmetric, affine])
    assert both.offsets is not None
    assert int(both.codes.min()) >= 0 and int(both.codes.max()) <= 15
    assert torch.equal(both.dequantize()[:16], symmetric.dequantize())
    assert torch.equal(both.dequantize()[16:], affine.dequantize())


def test_invalid_weights_are_refused() -> None:
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedWeight(codes, torch.ones(4, 3), None, 4, 24)
    with pytest.raises(ValueError, match="scales must be float32"):
        QuantizedWeight(codes, torch.ones(4, 3), None, 4, 32)
    with pytest.raises(ValueError, match="take no offsets"):
        QuantizedWeight(codes, torch.ones(4, 1), torch.ones(4, 1), 8, 64)
    with pytest.raises(ValueError, match="do not divide"):
        quantize_int4(torch.ones(4, 48))
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        fit(torch.ones(4, 64), "int3")
