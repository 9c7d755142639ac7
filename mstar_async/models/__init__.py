"""The model zoo: architecture-faithful models built with seeded weights, by name."""

from __future__ import annotations

from mstar_async.models import bagel as _bagel  # noqa: F401  (registers "bagel")
from mstar_async.models import causal_lm as _causal_lm  # noqa: F401  (registers "causal-lm")
from mstar_async.models import demo as _demo  # noqa: F401  (registers "demo")
from mstar_async.models import noop as _noop  # noqa: F401  (registers "noop")
from mstar_async.models import orpheus as _orpheus  # noqa: F401  (registers "orpheus")
from mstar_async.models import pi05 as _pi05  # noqa: F401  (registers "pi05")
from mstar_async.models import qwen3_omni as _qwen3_omni  # noqa: F401  (registers "qwen3-omni")
from mstar_async.models import qwen3_tts as _qwen3_tts  # noqa: F401  (registers "qwen3-tts")
from mstar_async.models import vad as _vad  # noqa: F401  (registers "silero-vad")
from mstar_async.models import vjepa2 as _vjepa2  # noqa: F401  (registers "vjepa2")
from mstar_async.models.registry import (
    ModelEntry,
    build_model,
    list_models,
    model_entry,
    register,
)

__all__ = ["ModelEntry", "build_model", "list_models", "model_entry", "register"]
