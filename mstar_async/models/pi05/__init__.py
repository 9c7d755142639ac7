"""``pi05``: a pi0.5-style vision-language-action policy (see ``model.py``)."""

from __future__ import annotations

from mstar_async.models.pi05.config import GemmaConfig, Pi05Config, make_config
from mstar_async.models.pi05.model import build_pi05

__all__ = ["GemmaConfig", "Pi05Config", "build_pi05", "make_config"]
