"""The models one server serves: each an open runtime plus its admission bound."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mstar_async.graph import Model
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime
from mstar_async.server.admission import Admission
from mstar_async.server.errors import APIError
from mstar_async.server.program_inputs import ProgramInputs

if TYPE_CHECKING:
    from mstar_async.worker.launchers import Launcher

#: Requests one model serves at once unless told otherwise.
DEFAULT_MAX_CONCURRENT = 64
#: Characters of speech text one request (or websocket segment) may carry unless told
#: otherwise: a few paragraphs, far more than one utterance needs.
DEFAULT_MAX_TEXT_CHARS = 4096


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: under ``name`` (default: the model's own), with an optional placement,
    its own in-flight bound and its own speech text limit in characters (defaults: the
    server's). ``make_launcher``, with a placement, makes the launcher that starts the model's
    ranks (e.g. ``lambda: RayLauncher.for_placement(placement, "auto", curve_keys=keys)``),
    called each time the model's runtime opens, since a launcher serves one runtime; None:
    child processes of the server's."""

    model: Model
    name: str | None = None
    placement: Placement | None = None
    max_concurrent: int | None = None
    max_text_chars: int | None = None
    make_launcher: Callable[[], Launcher] | None = None

    @property
    def served_name(self) -> str:
        """The name clients use in ``"model"`` fields."""
        return self.name or self.model.name


@dataclass
class ServedModel:
    """A model being served: its runtime, its admission bound, its program's inputs, and the
    most characters of speech text one request may carry (``max_text_chars``)."""

    name: str
    runtime: Runtime
    admission: Admission
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def inputs(self) -> list[str]:
        """The names of the program's inputs (what ``/generate`` accepts under ``inputs``)."""
        return list(self.defaults)

    @functools.cached_property
    def defaults(self) -> dict[str, Any]:
        """The program's inputs, each with its default (``inspect.Parameter.empty``: none)."""
        params = list(inspect.signature(self.runtime.model.program).parameters.values())
        return {p.name: p.default for p in params[1:]}  # the first is the request context

    @functools.cached_property
    def program_inputs(self) -> ProgramInputs:
        """Converts ``/generate``'s JSON inputs to what the program takes (checked types,
        tensors, decoded images)."""
        return ProgramInputs(self.runtime.model)

    @property
    def speaks(self) -> bool:
        """Whether the model makes speech from a ``text`` input (its ``info`` declares a
        ``sample_rate``): that text is held to ``max_text_chars``."""
        return self.runtime.model.info.get("sample_rate") is not None and "text" in self.inputs


class ServedModels(Mapping[str, ServedModel]):
    """Served models by name; ``get_or_404`` answers unknown names with the served ones."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, served: ServedModel) -> None:
        """Serve one more model.

        Raises:
            ValueError: a model of that name is served already.
        """
        if served.name in self._models:
            raise ValueError(f"model {served.name!r} is served twice: give one another name")
        self._models[served.name] = served

    def get_or_404(self, name: str) -> ServedModel:
        """The served model ``name``.

        Raises:
            APIError: 404 naming the served models.
        """
        served = self._models.get(name)
        if served is None:
            raise APIError(
                404,
                f"model {name!r} is not served here; served models: {sorted(self._models)}",
                param="model",
                type="model_not_found",
            )
        return served

    def __getitem__(self, name: str) -> ServedModel:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)
