"""The public async API: open a runtime for a model, generate, stream, cancel, close; per-request
metrics; speech sessions over text that arrives piece by piece (see docs/embedding.md)."""

from __future__ import annotations

from mstar_async.conductor import RequestMetrics, RequestStream
from mstar_async.runtime.runtime import Runtime, open_runtime
from mstar_async.runtime.session import SpeechSession, split_sentences
from mstar_async.runtime.stats import ConductorStats, RankStats, RuntimeStats
from mstar_async.worker.settings import RuntimeSettings

__all__ = [
    "ConductorStats",
    "RankStats",
    "RequestMetrics",
    "RequestStream",
    "Runtime",
    "RuntimeSettings",
    "RuntimeStats",
    "SpeechSession",
    "open_runtime",
    "split_sentences",
]
