"""``QuantLinear``: a linear layer whose weight is kept quantized and multiplied by torch's own
weight-only kernels (see ``kernels``).

- ``int8``: the weight's int8 codes ``[out, in]`` as they are, one scale per output row;
  ``y = x @ (code * scale).T``.
- ``int4``: the codes packed two to a byte by ``_convert_weight_to_int4pack_for_cpu``, with a
  scale and a zero per group of ``INT4_GROUP_SIZE`` inputs; the kernel computes with
  ``(code - 8) * scale + zero``, so affine codes (``scale * code + offset``) keep their scale and
  take ``zero = offset + 8 * scale``, and symmetric codes in [-8, 7] are stored as ``code + 8``
  with zero 0. Output rows are padded to a multiple of 16 (the packing's tile) with zero
  weights, and the padding is cut from the result.

Scales and zeros are held in the activations' dtype, as the kernels require: in float32 a
GGUF Q4_0 / Q4_1 block multiplies by exactly the values ``gguf`` dequantizes it to (``scale *
code + offset`` and ``(code - 8) * scale + (offset + 8 * scale)`` round to the same float32:
both products and the zero of float16 scales are exact; only a Q4_0 zero weight of a negative
scale is +0.0 where gguf has -0.0); in bfloat16 the scale and zero are rounded to bfloat16 (8
significant bits), an error of at most 1/64 of a quantization step per weight.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_async.models.quant.kernels import require_kernels
from mstar_async.models.quant.weights import INT4_GROUP_SIZE, QuantizedWeight

__all__ = ["QuantLinear"]

# The int4 packing handles output rows in tiles of this many.
_INT4_ROW_TILE = 16


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` quantized: int8 per output row or int4 per group.

    Activations must have the dtype the layer was built with (its scales' dtype). The packed
    weight, scales and bias are buffers, so ``.to(device)`` moves them; ``.to(dtype)`` changes
    the scales' and bias' dtype and hence the activations the layer takes.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """Pack ``weight`` for its kernel on ``device``, scales in ``dtype``. Blocks while
        packing (tens of milliseconds for a large matrix).

        Raises:
            ValueError: ``weight`` is in neither scheme's layout (8-bit codes with one scale
                per row, or 4-bit codes in groups of ``INT4_GROUP_SIZE``); ``dtype`` is not
                bfloat16, float16 or float32; ``bias`` does not have one value per output.
            QuantizationUnsupported: this torch has no kernel for the scheme on ``device``.
        """
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        rows, cols = weight.shape
        if weight.bits == 8 and weight.group_size == cols:
            self.scheme = "int8"
        elif weight.bits == 4 and weight.group_size == INT4_GROUP_SIZE:
            self.scheme = "int4"
        else:
            raise ValueError(
                f"a {weight.bits}-bit weight in groups of {weight.group_size} of {cols} columns "
                f"fits no kernel: int8 takes one scale per row, int4 groups of {INT4_GROUP_SIZE}"
            )
        if bias is not None and tuple(bias.shape) != (rows,):
            raise ValueError(f"bias must have shape ({rows},), got {tuple(bias.shape)}")
        require_kernels(self.scheme, device)
        self.in_features, self.out_features = cols, rows
        packed, scales = (_pack_int8 if self.scheme == "int8" else _pack_int4)(weight)
        self.register_buffer("packed", packed.to(device))
        self.register_buffer("scales", scales.to(device=device, dtype=dtype))
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(device=device, dtype=dtype)
        )

    @classmethod
    def from_packed(
        cls,
        scheme: str,
        in_features: int,
        out_features: int,
        *,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> QuantLinear:
        """A layer from the buffers of an earlier one (its ``state_dict``), without packing
        again. The scales' dtype is the layer's dtype. Never blocks beyond a shape check.

        Raises:
            ValueError: an unknown scheme, or buffers whose shapes or dtypes are not that
                scheme's packing of an ``[out_features, in_features]`` weight.
            QuantizationUnsupported: this torch has no kernel for the scheme on the buffers'
                device.
        """
        rows = out_features + (-out_features % _INT4_ROW_TILE if scheme == "int4" else 0)
        expected = {
            "int8": ((rows, in_features), torch.int8, (rows,)),
            "int4": (
                (rows, in_features // 2),
                torch.uint8,
                (in_features // INT4_GROUP_SIZE, rows, 2),
            ),
        }
        if scheme not in expected:
            raise ValueError(f"unknown quantization scheme {scheme!r}; schemes: int8, int4")
        packed_shape, packed_dtype, scales_shape = expected[scheme]
        if (
            tuple(packed.shape) != packed_shape
            or packed.dtype != packed_dtype
            or tuple(scales.shape) != scales_shape
            or (bias is not None and tuple(bias.shape) != (out_features,))
        ):
            raise ValueError(
                f"buffers do not hold an {scheme} packing of a {out_features} x {in_features} "
                f"weight: packed {tuple(packed.shape)} {packed.dtype}, scales "
                f"{tuple(scales.shape)}, bias {None if bias is None else tuple(bias.shape)}"
            )
        require_kernels(scheme, packed.device)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.scheme, layer.in_features, layer.out_features = scheme, in_features, out_features
        layer.register_buffer("packed", packed)
        layer.register_buffer("scales", scales)
        layer.register_buffer("bias", bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` (the layer's dtype) to ``[..., out_features]``.

        Raises:
            RuntimeError: from the kernel, for ``x`` of another dtype or width.
        """
        flat = x.reshape(-1, self.in_features).contiguous()
        y: torch.Tensor
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.packed, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, INT4_GROUP_SIZE, self.scales
            )
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows: sizes, scheme and dtype."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme}, dtype={self.scales.dtype}, bias={self.bias is not None}"
        )


def _pack_int8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    return weight.codes.contiguous(), weight.scales[:, 0].clone()


def _pack_int4(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    if weight.offsets is None:  # symmetric codes in [-8, 7]
        codes = weight.codes.to(torch.int32) + 8
        zeros = torch.zeros_like(weight.scales)
    else:  # affine codes in [0, 15]
        codes = weight.codes.to(torch.int32)
        zeros = weight.offsets + 8 * weight.scales
    pad = -rows % _INT4_ROW_TILE
    if pad:
        # Code 8 with scale 0 and zero 0 is a zero weight.
        codes = torch.cat([codes, torch.full((pad, cols), 8, dtype=torch.int32)])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    scales = torch.cat([weight.scales, weight.scales.new_zeros(pad, weight.scales.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    # [groups, rows, 2]: each group's scale and zero, as the kernel reads them.
    scale_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    return packed, scale_zeros
