"""The messages a conductor sends to the worker that runs a node."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Ops a worker runs between forwards instead of a forward: how a request's state (its KV)
#: moves from one rank to another. ``EXPORT_OP`` and ``IMPORT_OP`` go through an engine's
#: ``export_state`` / ``import_state`` (engines without them hold nothing to move);
#: ``DROP_OP`` releases the request in that engine alone, once its state has arrived elsewhere.
EXPORT_OP = "__export__"
IMPORT_OP = "__import__"
DROP_OP = "__drop__"


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


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor that stays on the worker that made it: which rank holds it, under which key.

    A worker keeps a step's large output tensors in its tensor store and replies with these
    handles instead of the bytes; the conductor forwards a handle as the input of a later step,
    and the worker that runs that step resolves it: from its own store when it holds the
    tensor, else by fetching it from ``rank`` over a direct worker-to-worker link. ``shape``
    and ``dtype`` (a torch dtype name, ``"float32"``) describe the tensor without its bytes.
    A handle is valid until its request is released on ``rank`` (or that worker restarts).
    """

    rank: int
    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """How many elements the tensor has."""
        n = 1
        for dim in self.shape:
            n *= dim
        return n
