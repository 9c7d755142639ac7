"""The public async API: open a runtime for a model, generate, stream, cancel, close."""

from __future__ import annotations

from mstar_async.runtime.runtime import Runtime, open_runtime

__all__ = ["Runtime", "open_runtime"]
