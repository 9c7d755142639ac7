"""``orpheus``: an Orpheus-style text-to-speech model (Llama LM over SNAC codes), streamed."""

from __future__ import annotations

from mstar_async.models.orpheus.model import SAMPLE_RATE, build_orpheus
from mstar_async.models.orpheus.vocab import VOICES, OrpheusVocab

__all__ = ["SAMPLE_RATE", "VOICES", "OrpheusVocab", "build_orpheus"]
