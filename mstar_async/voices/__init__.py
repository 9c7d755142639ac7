"""Registered voices: computed once from reference audio, stored on disk, shared by processes."""

from __future__ import annotations

from mstar_async.voices.registry import VoiceRegistry, decode_audio
from mstar_async.voices.store import StoredVoice, VoiceLimits, VoiceRecord, VoiceStore

__all__ = [
    "StoredVoice",
    "VoiceLimits",
    "VoiceRecord",
    "VoiceRegistry",
    "VoiceStore",
    "decode_audio",
]
