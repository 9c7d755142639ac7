"""The component graph G, the walks W over it, and their validation.

Declarative and checked when a ``Model`` is built; immutable after. Imports only policies.
"""

from __future__ import annotations

from mstar_async.graph.blocks import (
    Block,
    DynamicLoop,
    Loop,
    LoopStep,
    NodeRef,
    Parallel,
    Sequential,
    StreamEnd,
    Walk,
)
from mstar_async.graph.limits import ContextLimit, TokenCounter
from mstar_async.graph.model import Model, Program
from mstar_async.graph.nodes import Edge, Node, PortRef, stream
from mstar_async.graph.plan import EdgePlan, WalkPlan
from mstar_async.graph.source import ModelSource

__all__ = [
    "Block",
    "ContextLimit",
    "DynamicLoop",
    "Edge",
    "EdgePlan",
    "Loop",
    "LoopStep",
    "Model",
    "ModelSource",
    "Node",
    "NodeRef",
    "Parallel",
    "PortRef",
    "Program",
    "Sequential",
    "StreamEnd",
    "TokenCounter",
    "Walk",
    "WalkPlan",
    "stream",
]
