"""Which torch operators each weight-only scheme runs on, and whether this torch has them for a
device.

torch 2.13 ships weight-only matmuls for the CPU only (and the Meta device, which computes no
values): ``aten::_weight_int8pack_mm`` (activations ``[m, k]``, int8 weights ``[n, k]``, one
scale per output row) and ``aten::_weight_int4pack_mm_for_cpu`` (weights packed by
``aten::_convert_weight_to_int4pack_for_cpu`` from ``[n, k]`` int32 codes in [0, 15], ``n`` a
multiple of 16; scales and zeros ``[k / group, n, 2]``; group 32, 64, 128 or 256). Both take
scales in the activations' dtype. A CUDA build registers neither for CUDA, so asking for a
quantized form there fails up front, naming what is missing, rather than at the first forward.
"""

from __future__ import annotations

import torch

from mstar_async.errors import QuantizationUnsupported

__all__ = ["KERNELS", "missing_kernels", "require_kernels"]

#: The operators each scheme needs, by name under ``torch.ops.aten``.
KERNELS: dict[str, tuple[str, ...]] = {
    "int8": ("_weight_int8pack_mm",),
    "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"),
}

# The dispatch keys of device types whose key is not simply the upper-cased type.
_DISPATCH_KEYS = {"meta": "Meta", "privateuseone": "PrivateUse1"}


def missing_kernels(scheme: str, device: torch.device | str) -> list[str]:
    """The operators of ``scheme`` this torch has no kernel for on ``device``'s type (empty
    when it has them all).

    Raises:
        ValueError: an unknown ``scheme``.
    """
    if scheme not in KERNELS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; schemes: {', '.join(KERNELS)}")
    kind = torch.device(device).type
    key = _DISPATCH_KEYS.get(kind, kind.upper())
    missing: list[str] = []
    for name in KERNELS[scheme]:
        try:
            present = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)
        except RuntimeError:  # a device type torch has no dispatch key for
            present = False
        if not present:
            missing.append(name)
    return missing


def require_kernels(scheme: str, device: torch.device | str) -> None:
    """Check that ``scheme`` can run on ``device``. Never blocks.

    Raises:
        ValueError: an unknown ``scheme``.
        QuantizationUnsupported: this torch lacks one of its operators for the device type
            (the message names them, the device and the torch version).
    """
    missing = missing_kernels(scheme, device)
    if missing:
        kind = torch.device(device).type
        names = ", ".join(f"torch.ops.aten.{name}" for name in missing)
        raise QuantizationUnsupported(
            f"quantize={scheme!r} runs on {names}, which torch {torch.__version__} has no "
            f"{kind!r} kernel for; serve unquantized weights on this device (quantize=None), "
            "or quantized ones on the CPU"
        )
