"""``qwen3-omni``: thinker -> talker with code predictor -> code2wav, streaming text and speech."""

from __future__ import annotations

from mstar_async.models.qwen3_omni.model import build_qwen3_omni

__all__ = ["build_qwen3_omni"]
