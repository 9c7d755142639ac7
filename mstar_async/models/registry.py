"""The model zoo's registry: names to builders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar_async.errors import ModelNotFound
from mstar_async.graph import Model, ModelSource


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: its name, a one-line description, and the builder that makes it."""

    name: str
    description: str
    build: Callable[..., Model]


_REGISTRY: dict[str, ModelEntry] = {}


def register(name: str, description: str) -> Callable[[Callable[..., Model]], Callable[..., Model]]:
    """Decorator: register a builder ``build(**options) -> Model`` under ``name``.

    Raises:
        ValueError: the name is taken.
    """

    def decorate(build: Callable[..., Model]) -> Callable[..., Model]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = ModelEntry(name, description, build)
        return build

    return decorate


def list_models() -> list[ModelEntry]:
    """Every registered model, by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def build_model(name: str, **options: Any) -> Model:
    """Build the registered model ``name``.

    Raises:
        ModelNotFound: no model of that name; the message lists the registered ones.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ModelNotFound(f"no model {name!r}; registered models: {sorted(_REGISTRY)}")
    model = entry.build(**options)
    model.source = ModelSource("mstar_async.models:build_model", {"name": name, **options})
    return model
