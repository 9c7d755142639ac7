"""The floating dtypes a model builder takes by name (``dtype="bfloat16"``)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES"]

#: Names a builder's ``dtype`` accepts, and the torch dtype each means.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
