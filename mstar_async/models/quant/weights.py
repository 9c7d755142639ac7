"""Quantized weights as integer codes with per-group scales: the one form every source (a float
matrix, a GGUF file's blocks) is brought into before a kernel's packing.

A ``QuantizedWeight`` is a ``[rows, cols]`` matrix cut, along each row, into groups of
``group_size`` columns; each group has a float32 scale and, for affine codes, an offset:

    weight[r, c] = scale[r, g] * code[r, c] (+ offset[r, g]),   g = c // group_size

computed in float32, the product first, as ggml and ``gguf.quants.dequantize`` compute it, so a
GGUF block kept as codes dequantizes bit for bit as gguf's own dequantization. Codes are int8:
4-bit affine codes (with offsets) lie in [0, 15], 4-bit symmetric codes (no offsets) in [-8, 7],
8-bit codes (no offsets) in [-128, 127].

The two schemes the kernels run (``SCHEMES``):

- ``int8``: one symmetric scale per row (``group_size == cols``), codes in [-127, 127];
- ``int4``: groups of ``INT4_GROUP_SIZE`` (32) columns, affine codes (min/max per group, as
  GGUF's Q4_1) or symmetric codes (as Q4_0).

``fit(weight, scheme)`` brings a float matrix or another quantized weight into a scheme: as it
is where it already has the scheme's layout (Q4_0 and Q4_1 blocks for ``int4``: exact), else
requantized from its exact float values (Q8_0 blocks for either scheme, 4-bit blocks for
``int8``, any float matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "INT4_GROUP_SIZE",
    "SCHEMES",
    "QuantizedWeight",
    "fit",
    "quantize_int4",
    "quantize_int8",
]

#: The weight-only schemes, by the names ``quantize=`` takes.
SCHEMES = ("int8", "int4")

#: Columns per scale of the int4 scheme: GGUF's Q4_0 / Q4_1 block size, the smallest group the
#: CPU int4 kernel takes (32, 64, 128 or 256), and the most accurate of those.
INT4_GROUP_SIZE = 32


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A ``[rows, cols]`` matrix as int8 codes, float32 scales per group of columns and, for
    affine codes, float32 offsets per group (see the module docstring for the arithmetic).

    Attributes:
        codes: ``[rows, cols]`` int8.
        scales: ``[rows, cols // group_size]`` float32.
        offsets: like ``scales``, or ``None`` for symmetric codes.
        bits: 4 or 8: the range the codes lie in.
        group_size: columns per scale; ``cols`` for one scale per row.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        """Check shapes and dtypes (not the codes' values: that would read every code).

        Raises:
            ValueError: a shape, dtype, ``bits`` or ``group_size`` that does not fit.
        """
        if self.codes.dim() != 2 or self.codes.dtype != torch.int8:
            raise ValueError(
                f"codes must be a 2-D int8 tensor, got {tuple(self.codes.shape)} {self.codes.dtype}"
            )
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.bits == 8 and self.offsets is not None:
            raise ValueError("8-bit codes are symmetric: they take no offsets")
        rows, cols = self.codes.shape
        if self.group_size < 1 or cols % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide {cols} columns")
        want = (rows, cols // self.group_size)
        for name, tensor in (("scales", self.scales), ("offsets", self.offsets)):
            if tensor is None:
                continue
            if tuple(tensor.shape) != want or tensor.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be float32 {want}, got {tuple(tensor.shape)} {tensor.dtype}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix."""
        rows, cols = self.codes.shape
        return int(rows), int(cols)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[rows, cols]`` matrix: ``scale * code``, then ``+ offset``, per group.
        Never raises."""
        rows, cols = self.shape
        groups = cols // self.group_size
        codes = self.codes.reshape(rows, groups, self.group_size).to(torch.float32)
        values = self.scales.unsqueeze(-1) * codes
        if self.offsets is not None:
            values = values + self.offsets.unsqueeze(-1)
        return values.reshape(rows, cols)

    def map_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with its rows moved by ``reorder`` (a function of a tensor whose
        dim 0 is the rows, applied to codes, scales and offsets alike). Raises what
        ``reorder`` raises."""
        offsets = None if self.offsets is None else reorder(self.offsets)
        return QuantizedWeight(
            reorder(self.codes), reorder(self.scales), offsets, self.bits, self.group_size
        )

    def affine(self) -> QuantizedWeight:
        """The same weight with affine codes: 4-bit symmetric codes ``c`` in [-8, 7] become
        ``c + 8`` with offsets ``-8 * scale`` (the same values; a zero weight may lose its
        sign); a weight that has offsets, or 8-bit codes, comes back as it is. Never raises."""
        if self.bits != 4 or self.offsets is not None:
            return self
        return QuantizedWeight(self.codes + 8, self.scales, -8 * self.scales, 4, self.group_size)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The rows of ``parts``, one after another (fused projections). 4-bit parts with and
        without offsets (Q4_1 beside Q4_0 blocks) are joined as affine codes (``affine``).

        Raises:
            ValueError: no parts, or parts of different columns, bits or groups.
        """
        if not parts:
            raise ValueError("cat needs at least one weight")
        if len({p.offsets is None for p in parts}) > 1:
            parts = [p.affine() for p in parts]
        first = parts[0]
        for part in parts[1:]:
            if (part.shape[1], part.bits, part.group_size) != (
                first.shape[1],
                first.bits,
                first.group_size,
            ):
                raise ValueError("cat needs weights of the same columns, bits and groups")
        offsets = (
            None if first.offsets is None else torch.cat([p.offsets for p in parts])  # type: ignore[misc]
        )
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            offsets,
            first.bits,
            first.group_size,
        )


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` ``[rows, cols]`` as symmetric 8-bit codes with one scale per row:
    ``scale = max|row| / 127``, ``code = round(w / scale)``; an all-zero row gets scale 0.

    Raises:
        ValueError: ``weight`` is not a 2-D floating tensor.
    """
    values = _float_matrix(weight)
    scales = values.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = torch.round(values * inverse).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(codes, scales, None, 8, values.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """``weight`` ``[rows, cols]`` as affine 4-bit codes per group of ``group_size`` columns,
    from each group's minimum and maximum as GGUF's Q4_1 does: ``scale = (max - min) / 15``,
    ``offset = min``, ``code = round((w - min) / scale)`` in [0, 15]; a constant group gets
    scale 0 and codes 0.

    Raises:
        ValueError: ``weight`` is not a 2-D floating tensor, or ``group_size`` does not divide
            its columns.
    """
    values = _float_matrix(weight)
    rows, cols = values.shape
    if group_size < 1 or cols % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide {cols} columns")
    groups = values.reshape(rows, cols // group_size, group_size)
    low = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - low) / 15
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = torch.round((groups - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp_(0, 15)
    return QuantizedWeight(codes.to(torch.int8).reshape(rows, cols), scales, low, 4, group_size)


def fit(weight: torch.Tensor | QuantizedWeight, scheme: str) -> QuantizedWeight:
    """``weight`` in the layout of ``scheme`` (``"int8"`` or ``"int4"``).

    A quantized weight already in that layout is returned as it is (4-bit codes in groups of
    ``INT4_GROUP_SIZE`` for int4; 8-bit codes, one scale per row, for int8); any other is
    dequantized exactly and quantized again; a float matrix is quantized.

    Raises:
        ValueError: an unknown ``scheme``; a float ``weight`` that is not a 2-D floating tensor;
            int4 groups that do not divide its columns.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; schemes: {', '.join(SCHEMES)}")
    if isinstance(weight, QuantizedWeight):
        if scheme == "int4" and weight.bits == 4 and weight.group_size == INT4_GROUP_SIZE:
            return weight
        if scheme == "int8" and weight.bits == 8 and weight.group_size == weight.shape[1]:
            return weight
        weight = weight.dequantize()
    return quantize_int8(weight) if scheme == "int8" else quantize_int4(weight)


def _float_matrix(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"expected a 2-D floating weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    return weight.detach().to(torch.float32)
