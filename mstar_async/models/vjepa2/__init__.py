"""``vjepa2``: a V-JEPA 2-AC world model (ViT encoder, action-conditioned predictor) served
with a block-causal KV cache, and the reference rollout that recomputes every step."""

from __future__ import annotations

from mstar_async.models.vjepa2.config import SIZES, VJEPA2Config, make_config
from mstar_async.models.vjepa2.model import build_vjepa2
from mstar_async.models.vjepa2.rollout import RolloutInputs, random_inputs, recompute_rollout

__all__ = [
    "SIZES",
    "RolloutInputs",
    "VJEPA2Config",
    "build_vjepa2",
    "make_config",
    "random_inputs",
    "recompute_rollout",
]
