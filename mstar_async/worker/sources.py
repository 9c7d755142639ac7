"""What a worker that joins over the network agrees to build.

A worker the runtime starts itself (``LocalLauncher``, ``RayLauncher``) builds whatever model
source the runtime hands it: the runtime's own code chose it. A worker that joins over TCP
(``mstar worker``) learns its source from whoever answers its join, so it builds only what its
own command line allows: a model of the zoo, by name (every name, or those given with
``--model``), with keyword options that are plain data, or a builder ``module:function`` given
with ``--source``. Anything else is refused before anything named in it is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_async.errors import SourceRefused
from mstar_async.graph import ModelSource

__all__ = ["ZOO_BUILDER", "AllowedSources"]

#: The builder behind every zoo model's source (``build_model(name, **options)``).
ZOO_BUILDER = "mstar_async.models:build_model"

_PLAIN = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class AllowedSources:
    """The model sources a joining worker builds: zoo models (``models``: those names; None:
    every name) and the builders in ``builders`` (``module:function``)."""

    models: frozenset[str] | None = None
    builders: frozenset[str] = frozenset()

    def check(self, source: Any) -> ModelSource:
        """The source the runtime asked for, if this worker may build it. Imports nothing.

        Raises:
            SourceRefused: ``source`` is not ``{"target": ..., "options": {...}}`` with plain
                data options, or names a builder or zoo model this worker was not allowed;
                the message names what was asked and what is allowed.
        """
        target, options = _parse(source)
        if target in self.builders:
            return ModelSource(target, options)
        if target != ZOO_BUILDER:
            raise SourceRefused(
                f"the runtime asked this worker to build {target!r}, which it was not "
                f"started to build; it builds {self.describe()}. If that builder is yours, "
                f"start the worker with --source {target}"
            )
        name = options.get("name")
        if not isinstance(name, str):
            raise SourceRefused(f"the runtime sent a zoo model source without a name: {source!r}")
        if self.models is not None and name not in self.models:
            raise SourceRefused(
                f"the runtime asked this worker to build the zoo model {name!r}; it builds "
                f"{self.describe()}. To allow that model, start the worker with --model {name}"
            )
        return ModelSource(target, options)

    def describe(self) -> str:
        """What this worker builds, in words. Never raises."""
        zoo = "any zoo model" if self.models is None else f"the zoo models {sorted(self.models)}"
        extra = f" and the builders {sorted(self.builders)}" if self.builders else ""
        return zoo + extra


def _parse(source: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(source, Mapping) or not set(source) <= {"target", "options"}:
        raise SourceRefused(f"the runtime sent a malformed model source: {source!r}")
    target, options = source.get("target"), source.get("options", {})
    if not isinstance(target, str) or not isinstance(options, Mapping):
        raise SourceRefused(f"the runtime sent a malformed model source: {source!r}")
    if not _is_plain(dict(options)):
        raise SourceRefused(f"the options of model source {target!r} are not plain data")
    return target, dict(options)


def _is_plain(value: Any) -> bool:
    # What JSON carries: a builder's options can name files and sizes, never objects to call.
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
