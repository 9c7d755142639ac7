"""The model zoo's registry: names to builders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mstar_async.errors import ModelNotFound
from mstar_async.graph import Model, ModelSource


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: its name, a one-line description, the builder that makes it, and
    the program inputs a caller must give (``required``: a speech model's ``text``; the program
    may default them for embedding code and tests, but ``mstar run`` asks for them)."""

    name: str
    description: str
    build: Callable[..., Model]
    required: tuple[str, ...] = ()


_REGISTRY: dict[str, ModelEntry] = {}


def register(
    name: str, description: str, *, required: tuple[str, ...] = ()
) -> Callable[[Callable[..., Model]], Callable[..., Model]]:
    """Decorator: register a builder ``build(**options) -> Model`` under ``name``;
    ``required`` names the program inputs a caller must give.

    Raises:
        ValueError: the name is taken.
    """

    def decorate(build: Callable[..., Model]) -> Callable[..., Model]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = ModelEntry(name, description, build, required)
        return build

    return decorate


def list_models() -> list[ModelEntry]:
    """Every registered model, by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def model_entry(name: str) -> ModelEntry:
    """The registered model ``name``, without building it.

    Raises:
        ModelNotFound: no model of that name; the message lists the registered ones.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ModelNotFound(f"no model {name!r}; registered models: {sorted(_REGISTRY)}")
    return entry


def build_model(name: str, **options: Any) -> Model:
    """Build the registered model ``name``.

    Raises:
        ModelNotFound: no model of that name; the message lists the registered ones.
    """
    model = model_entry(name).build(**options)
    model.source = ModelSource("mstar_async.models:build_model", {"name": name, **options})
    return model
