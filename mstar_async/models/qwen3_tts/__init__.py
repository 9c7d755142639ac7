"""``qwen3-tts``: talker with code predictor -> 12 Hz speech decoder; named and cloned voices."""

from __future__ import annotations

from mstar_async.models.qwen3_tts.model import build_qwen3_tts
from mstar_async.models.qwen3_tts.voice import VoicePrompt

__all__ = ["VoicePrompt", "build_qwen3_tts"]
