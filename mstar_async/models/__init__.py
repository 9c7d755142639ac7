"""The model zoo: architecture-faithful models built with seeded weights, by name (each
model's module is imported when its name is first used)."""

from __future__ import annotations

from mstar_async.models.registry import (
    ModelEntry,
    build_model,
    list_models,
    model_entry,
    register,
)

__all__ = ["ModelEntry", "build_model", "list_models", "model_entry", "register"]
