"""The model zoo's registry: names to builders.

The zoo's own models register when their module is imported, which happens on first use of
their name (``ZOO``): a command that builds one model imports that model's code only (the
others' imports cost a cold start a third of a second on two cores).
"""

from __future__ import annotations

import importlib
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

#: The zoo: each model's name and the module (of ``mstar_async.models``) that registers it.
ZOO = {
    "bagel": "bagel",
    "causal-lm": "causal_lm",
    "demo": "demo",
    "noop": "noop",
    "orpheus": "orpheus",
    "pi05": "pi05",
    "qwen3-omni": "qwen3_omni",
    "qwen3-tts": "qwen3_tts",
    "silero-vad": "vad",
    "vjepa2": "vjepa2",
}


def _load(name: str) -> None:
    # A name from this fixed table only: nothing a caller passes names a module to import.
    module = ZOO.get(name)
    if module is not None and name not in _REGISTRY:
        importlib.import_module(f"mstar_async.models.{module}")


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
    """Every registered model, by name (the whole zoo imported)."""
    for name in ZOO:
        _load(name)
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def model_entry(name: str) -> ModelEntry:
    """The registered model ``name``, without building it.

    Raises:
        ModelNotFound: no model of that name; the message lists the registered ones.
    """
    _load(name)
    entry = _REGISTRY.get(name)
    if entry is None:
        known = sorted({*_REGISTRY, *ZOO})
        raise ModelNotFound(f"no model {name!r}; registered models: {known}")
    return entry


def build_model(name: str, **options: Any) -> Model:
    """Build the registered model ``name``.

    Raises:
        ModelNotFound: no model of that name; the message lists the registered ones.
    """
    model = model_entry(name).build(**options)
    model.source = ModelSource("mstar_async.models:build_model", {"name": name, **options})
    return model
