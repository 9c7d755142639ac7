"""The messages a conductor sends to the worker that runs a node."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Ops a worker runs through an engine's ``export_state`` / ``import_state`` (when it has them)
#: instead of a forward: how a request's state (its KV) moves from one rank to another.
EXPORT_OP = "__export__"
IMPORT_OP = "__import__"


@dataclass(frozen=True, slots=True)
class StepCall:
    """One step of one node for one request: run ``op`` of ``engine`` on ``inputs``.

    ``inputs`` maps the node's input port names to values (tensors, chunks, plain Python values).
    The worker batches calls for the same engine and op from many requests into one forward.
    ``node`` and ``walk`` say where in the model the step comes from, which is what placement
    maps to a rank.
    """

    request_id: str
    engine: str
    op: str
    inputs: Mapping[str, Any]
    node: str = ""
    walk: str = ""
