"""``ModelSource``: how another process rebuilds a model (worker processes build their engines)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mstar_async.errors import GraphError

if TYPE_CHECKING:
    from mstar_async.graph.model import Model


@dataclass(frozen=True)
class ModelSource:
    """A builder ``"package.module:function"`` and the JSON-able keyword options to call it with.

    The zoo's ``build_model`` stamps every model it builds with one, so placements that put
    components in worker processes can rebuild the same model there.
    """

    target: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> Model:
        """Import the builder and call it.

        Raises:
            GraphError: the target is not ``module:function`` or cannot be imported.
        """
        module_name, _, function = self.target.partition(":")
        if not module_name or not function:
            raise GraphError(
                f"model source {self.target!r} must look like 'package.module:function'"
            )
        try:
            builder = getattr(importlib.import_module(module_name), function)
        except (ImportError, AttributeError) as exc:
            raise GraphError(f"cannot import model builder {self.target!r}: {exc}") from exc
        model: Model = builder(**dict(self.options))
        return model

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, for a worker process's configuration."""
        return {"target": self.target, "options": dict(self.options)}
