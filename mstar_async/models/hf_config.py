"""Reading sections of a transformers ``config.json`` into our config dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["known_fields", "lower_names"]


def known_fields(cls: type[Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``config`` that name fields of dataclass ``cls``, JSON lists as tuples;
    absent keys are left to the dataclass's defaults (upstream's). Pure; raises nothing."""
    return {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in config.items()
        if k in cls.__dataclass_fields__
    }


def lower_names(ids: Mapping[str, Any] | None) -> tuple[tuple[str, int], ...]:
    """A config's ``name -> id`` table (speakers, languages) as ``(lower-case name, id)``
    pairs in its order; none for ``None``.

    Raises:
        ValueError, TypeError: an id that is not an integer.
    """
    return tuple((name.lower(), int(value)) for name, value in (ids or {}).items())
