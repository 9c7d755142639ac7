"""Weight-only quantization of a decoder's linears (int8 per output row, int4 per group of 32
inputs) on torch's own weight-only kernels.

- ``QuantizedWeight``: codes and per-group scales, the form every source is brought into;
  ``fit`` puts a float matrix or GGUF blocks into a scheme's layout (``weights``).
- ``QuantLinear``: a linear layer packed for a kernel (``linear``); ``require_kernels`` says up
  front whether this torch has the kernels for a device (``kernels``).
- ``FORMS`` and ``quantize_linears``: the named weight forms and the swap of a
  ``PagedDecoder``'s linears while its weights are read (``decoder``).
"""

from __future__ import annotations

from mstar_async.models.quant.decoder import FORMS, QuantizedSource, quantize_linears
from mstar_async.models.quant.kernels import KERNELS, missing_kernels, require_kernels
from mstar_async.models.quant.linear import QuantLinear
from mstar_async.models.quant.weights import (
    INT4_GROUP_SIZE,
    SCHEMES,
    QuantizedWeight,
    fit,
    quantize_int4,
    quantize_int8,
)

__all__ = [
    "FORMS",
    "INT4_GROUP_SIZE",
    "KERNELS",
    "SCHEMES",
    "QuantLinear",
    "QuantizedSource",
    "QuantizedWeight",
    "fit",
    "missing_kernels",
    "quantize_int4",
    "quantize_int8",
    "quantize_linears",
    "require_kernels",
]
