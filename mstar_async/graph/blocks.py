"""The primitives a walk is built from: ``Sequential``, ``Parallel``, ``Loop``, ``DynamicLoop``.

Blocks compare by identity (``eq=False``): the same-looking loop in two places is two loops, and
the planner keys its per-loop facts on the block object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from mstar_async.errors import GraphError
from mstar_async.graph.nodes import Node, PortRef, check_name
from mstar_async.policies import ChunkPolicy


@dataclass(frozen=True, eq=False)
class NodeRef:
    """A leaf of a walk: the node of that name in the model's graph."""

    name: str


@dataclass(frozen=True, eq=False)
class Sequential:
    """Run children in order; a child that consumes a stream from an earlier child starts as
    soon as that child starts (a pipeline), any other child when the previous one has finished."""

    children: tuple[Block, ...]

    def __init__(self, *children: BlockLike) -> None:
        object.__setattr__(self, "children", tuple(as_block(c) for c in children))


@dataclass(frozen=True, eq=False)
class Parallel:
    """Run branches concurrently (fan-out); their outputs are gathered by port name. Branches
    may not feed each other. Steps of the same engine and op from different branches batch
    together (classifier-free-guidance branches become one forward)."""

    branches: tuple[Block, ...]

    def __init__(self, *branches: BlockLike) -> None:
        object.__setattr__(self, "branches", tuple(as_block(b) for b in branches))


def _carry_map(
    carry: Mapping[str, str | Sequence[str]] | None,
) -> dict[PortRef, tuple[PortRef, ...]]:
    result: dict[PortRef, tuple[PortRef, ...]] = {}
    for src, dsts in (carry or {}).items():
        targets = (dsts,) if isinstance(dsts, str) else tuple(dsts)
        result[PortRef.parse(src, role="carry source")] = tuple(
            PortRef.parse(d, role="carry target") for d in targets
        )
    return result


@dataclass(frozen=True)
class StreamEnd:
    """What a loop's stream port holds in the iterations after its stream's final chunk, in a
    ``DynamicLoop`` with ``outlives_streams``: the stream has ended and brings nothing more.
    Instances are equal; one travels between processes as itself."""


@dataclass(slots=True)
class LoopStep:
    """What a ``DynamicLoop``'s ``until`` sees after each iteration of one request (read it,
    do not change it: one is made per iteration, and a frozen dataclass costs three times as
    much to make)."""

    iteration: int
    outputs: Mapping[str, Any]
    params: Mapping[str, Any]


@dataclass(frozen=True, eq=False)
class Loop:
    """Run ``body`` a fixed number of times per request.

    ``iterations`` is an int >= 1 or the name of a walk parameter holding one. ``carry`` maps an
    output port of the body to the input port(s) it feeds in the next iteration; in the first
    iteration those inputs come from their edges or the walk's inputs.

    Raises:
        GraphError: ``iterations`` is below 1 or not an int or parameter name; a carry port is
            not ``node.port``.
    """

    body: Block
    iterations: int | str
    carry: Mapping[PortRef, tuple[PortRef, ...]] = field(default_factory=dict)

    def __init__(
        self,
        body: BlockLike,
        iterations: int | str,
        carry: Mapping[str, str | Sequence[str]] | None = None,
    ) -> None:
        if isinstance(iterations, str):
            check_name("Loop iterations parameter", iterations)
        elif isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise GraphError(
                "Loop iterations must be an int >= 1 (or a walk parameter name), "
                f"got {iterations!r}"
            )
        object.__setattr__(self, "body", as_block(body))
        object.__setattr__(self, "iterations", iterations)
        object.__setattr__(self, "carry", _carry_map(carry))


@dataclass(frozen=True, eq=False)
class DynamicLoop:
    """Run ``body`` until ``until(step)`` is true for this request, at most ``max_iterations``.

    ``until`` is called after every iteration with a ``LoopStep`` (iteration index, the
    iteration's outputs by ``"node.port"``, the walk's parameters); each request leaves the loop
    on its own. A loop whose body consumes a stream from outside takes one chunk per iteration
    and, by default, also ends when that stream ends (after its final chunk). With
    ``outlives_streams`` it goes on instead: in every later iteration the stream's port holds
    ``StreamEnd()``, and only ``until`` or ``max_iterations`` end the loop (a talker that speaks
    on after its text).

    Raises:
        GraphError: ``max_iterations`` is below 1, or ``until`` is not callable.
    """

    body: Block
    until: Callable[[LoopStep], bool]
    max_iterations: int
    carry: Mapping[PortRef, tuple[PortRef, ...]] = field(default_factory=dict)
    outlives_streams: bool = False

    def __init__(
        self,
        body: BlockLike,
        *,
        until: Callable[[LoopStep], bool],
        max_iterations: int,
        carry: Mapping[str, str | Sequence[str]] | None = None,
        outlives_streams: bool = False,
    ) -> None:
        if not callable(until):
            raise GraphError(f"DynamicLoop until must be callable(LoopStep) -> bool, got {until!r}")
        bad = isinstance(max_iterations, bool) or not isinstance(max_iterations, int)
        if bad or max_iterations < 1:
            raise GraphError(
                f"DynamicLoop max_iterations must be an int >= 1, got {max_iterations!r}"
            )
        object.__setattr__(self, "body", as_block(body))
        object.__setattr__(self, "until", until)
        object.__setattr__(self, "max_iterations", max_iterations)
        object.__setattr__(self, "carry", _carry_map(carry))
        object.__setattr__(self, "outlives_streams", bool(outlives_streams))


AnyLoop: TypeAlias = Loop | DynamicLoop
Block: TypeAlias = NodeRef | Sequential | Parallel | Loop | DynamicLoop
BlockLike: TypeAlias = Block | Node | str


def as_block(item: BlockLike) -> Block:
    """Turn a node name or ``Node`` into a ``NodeRef``; pass blocks through.

    Raises:
        GraphError: ``item`` is none of a block, a ``Node`` or a node name.
    """
    if isinstance(item, str):
        return NodeRef(check_name("node", item))
    if isinstance(item, Node):
        return NodeRef(item.name)
    if isinstance(item, NodeRef | Sequential | Parallel | Loop | DynamicLoop):
        return item
    raise GraphError(
        "a walk may hold node names, Nodes, Sequential, Parallel, Loop or DynamicLoop; "
        f"got {item!r}"
    )


def children(block: Block) -> tuple[Block, ...]:
    """The direct sub-blocks of ``block``."""
    if isinstance(block, Sequential):
        return block.children
    if isinstance(block, Parallel):
        return block.branches
    if isinstance(block, Loop | DynamicLoop):
        return (block.body,)
    return ()


def node_names(block: Block) -> list[str]:
    """Every node name under ``block``, in walk order (repeats kept, for duplicate checks)."""
    if isinstance(block, NodeRef):
        return [block.name]
    return [name for child in children(block) for name in node_names(child)]


@dataclass(frozen=True)
class Walk:
    """A named section of the graph that one phase of a request runs (``prefill``, ``speak``).

    ``outputs`` lists the ``"node.port"``s the walk hands back to the request program; by
    default every output port of its nodes that no edge consumes.

    ``streams`` maps walk input ports (``"node.port"``) that arrive as a stream while the walk
    runs (audio frames as a user speaks) to the chunk policy that cuts them; the program passes
    an async iterable for such an input, and the node fires once per chunk. ``max_buffer``
    bounds the chunks waiting for the node: the feed waits beyond it (backpressure).

    Raises:
        GraphError: the name is invalid, or ``max_buffer`` is below 1.
    """

    name: str
    body: Block
    outputs: tuple[str, ...] | None = None
    streams: tuple[tuple[str, ChunkPolicy], ...] = ()
    max_buffer: int = 8

    def __init__(
        self,
        name: str,
        body: BlockLike,
        outputs: Sequence[str] | None = None,
        *,
        streams: Mapping[str, ChunkPolicy] | None = None,
        max_buffer: int = 8,
    ) -> None:
        object.__setattr__(self, "name", check_name("walk", name))
        object.__setattr__(self, "body", as_block(body))
        object.__setattr__(self, "outputs", None if outputs is None else tuple(outputs))
        object.__setattr__(self, "streams", tuple((streams or {}).items()))
        if not isinstance(max_buffer, int) or max_buffer < 1:
            raise GraphError(f"walk {name!r}: max_buffer must be an int >= 1, got {max_buffer!r}")
        object.__setattr__(self, "max_buffer", max_buffer)
