"""``bagel``: a BAGEL-style unified text+image model (see ``model.py``)."""

from __future__ import annotations

from mstar_async.models.bagel.config import SIZES, BagelConfig, bagel_config, tokenize
from mstar_async.models.bagel.model import BRANCHES, CFG_MODES, build_bagel

__all__ = [
    "BRANCHES",
    "CFG_MODES",
    "SIZES",
    "BagelConfig",
    "bagel_config",
    "build_bagel",
    "tokenize",
]
