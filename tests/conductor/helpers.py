"""Small builders for conductor tests: models made of arithmetic ops on tensors."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import torch

from mstar_async.engines import StatelessEngine
from mstar_async.graph import Edge, Model, Node, Walk


def make_model(
    nodes: Sequence[Node],
    walks: Sequence[Walk],
    program: Callable[..., AsyncGenerator[Any, None]],
    ops: Mapping[str, Callable[..., Mapping[str, Any]]],
    edges: Sequence[Edge] = (),
) -> Model:
    """A model whose every node runs on one StatelessEngine called "e" with ``ops``."""
    return Model(
        "test",
        nodes=nodes,
        walks=walks,
        edges=edges,
        program=program,
        components={"e": lambda: StatelessEngine(ops)},
    )


def t(value: float) -> torch.Tensor:
    return torch.tensor(float(value))
