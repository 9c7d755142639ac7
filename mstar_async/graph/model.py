"""``Model``: a graph of components, the walks over it, and the request program that runs them."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from mstar_async.errors import GraphError
from mstar_async.graph.blocks import Walk, node_names
from mstar_async.graph.limits import ContextLimit
from mstar_async.graph.nodes import Edge, Node, check_name
from mstar_async.graph.plan import WalkPlan, plan_walk
from mstar_async.graph.source import ModelSource

#: A request program: an async generator function ``program(request, **inputs)`` that awaits and
#: iterates walks through ``request`` and yields outputs as they are made.
Program = Callable[..., AsyncGenerator[Any, None]]

#: Builds one component (an engine) where placement puts it; called once per worker.
ComponentFactory = Callable[[], Any]


class Model:
    """A composite model: the pair (G, W) plus its request program and its components.

    Validated when built and immutable after. ``components`` maps each engine name that a node
    names to a zero-argument factory that builds that engine (so a worker process can build the
    engines placement gives it). ``context`` declares how long one request may be (see
    ``ContextLimit``); a server refuses a request past it before admitting it.

    Raises:
        GraphError: any rule is broken: a duplicate node or walk name, an edge to an unknown node
            or port, an edge whose consumer is in no walk, two edges into one port, a cycle of
            edges outside a loop, a node in no walk, a node naming an engine the model lacks, or
            any per-walk rule (see ``plan_walk``).
    """

    def __init__(
        self,
        name: str,
        *,
        nodes: Sequence[Node],
        walks: Sequence[Walk],
        program: Program,
        components: Mapping[str, ComponentFactory],
        edges: Sequence[Edge] = (),
        description: str = "",
        info: Mapping[str, Any] | None = None,
        context: ContextLimit | None = None,
    ) -> None:
        self.name = check_name("model", name)
        self.description = description
        #: Facts servers and clients read without running a request (JSON-able values), e.g.
        #: ``sample_rate``, ``voices``, ``image_size``.
        self.info: Mapping[str, Any] = MappingProxyType(dict(info or {}))
        #: How long one request may be (None: the model declares no limit).
        self.context = context
        self.program = program
        self.nodes: Mapping[str, Node] = MappingProxyType(_index_nodes(nodes))
        self.edges: tuple[Edge, ...] = tuple(edges)
        self.components: Mapping[str, ComponentFactory] = MappingProxyType(dict(components))
        self.walks: Mapping[str, Walk] = MappingProxyType(_index_walks(walks))
        _check_components(self.nodes, self.components)
        _check_edges(self.nodes, self.edges, self.walks)
        _check_acyclic(self.nodes, self.edges)
        #: How another process rebuilds this model (set by the zoo's ``build_model``).
        self.source: ModelSource | None = None
        self.plans: Mapping[str, WalkPlan] = MappingProxyType(
            {w.name: plan_walk(w, self.nodes, list(self.edges)) for w in self.walks.values()}
        )

    def plan(self, walk: str) -> WalkPlan:
        """The plan of the walk called ``walk``.

        Raises:
            GraphError: the model has no such walk; the message lists its walks.
        """
        try:
            return self.plans[walk]
        except KeyError:
            raise GraphError(
                f"model {self.name!r} has no walk {walk!r}; its walks are {sorted(self.plans)}"
            ) from None

    def __repr__(self) -> str:
        return f"Model({self.name!r}, nodes={list(self.nodes)}, walks={list(self.walks)})"


def _index_nodes(nodes: Sequence[Node]) -> dict[str, Node]:
    index: dict[str, Node] = {}
    for node in nodes:
        if not isinstance(node, Node):
            raise GraphError(f"nodes must be Node objects, got {node!r}")
        if node.name in index:
            raise GraphError(f"node name {node.name!r} is used twice; give each node its own name")
        index[node.name] = node
    return index


def _index_walks(walks: Sequence[Walk]) -> dict[str, Walk]:
    index: dict[str, Walk] = {}
    for walk in walks:
        if walk.name in index:
            raise GraphError(f"walk name {walk.name!r} is used twice; give each walk its own name")
        index[walk.name] = walk
    if not index:
        raise GraphError("a model needs at least one walk")
    return index


def _check_components(
    nodes: Mapping[str, Node], components: Mapping[str, ComponentFactory]
) -> None:
    for node in nodes.values():
        if node.engine not in components:
            raise GraphError(
                f"node {node.name!r} names engine {node.engine!r}, "
                "which the model does not define; "
                f"add it to components= (defined: {sorted(components)})"
            )


def _check_edges(
    nodes: Mapping[str, Node], edges: Sequence[Edge], walks: Mapping[str, Walk]
) -> None:
    in_walks = {name for walk in walks.values() for name in node_names(walk.body)}
    fed: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        if not isinstance(edge, Edge):
            raise GraphError(f"edges must be Edge objects, got {edge!r}")
        for ref, role in ((edge.src_ref, "source"), (edge.dst_ref, "destination")):
            if ref.node not in nodes:
                raise GraphError(
                    f"edge {edge}: its {role} names unknown node {ref.node!r}; "
                    f"known nodes: {sorted(nodes)}"
                )
        src, dst = nodes[edge.src_ref.node], nodes[edge.dst_ref.node]
        if edge.src_ref.port not in src.outputs:
            raise GraphError(
                f"edge {edge}: node {src.name!r} has no output port {edge.src_ref.port!r} "
                f"(outputs: {list(src.outputs)})"
            )
        if edge.dst_ref.port not in dst.inputs:
            raise GraphError(
                f"edge {edge} has no consumer: node {dst.name!r} has no input port "
                f"{edge.dst_ref.port!r} (inputs: {list(dst.inputs)})"
            )
        if dst.name not in in_walks:
            raise GraphError(
                f"edge {edge} has no consumer: node {dst.name!r} is in no walk; add it to a walk "
                "or remove the edge"
            )
        key = (dst.name, edge.dst_ref.port)
        if key in fed:
            raise GraphError(
                f"input {edge.dst} is fed by two edges ({fed[key]} and {edge}); keep one"
            )
        fed[key] = edge
    for name in nodes:
        if name not in in_walks:
            raise GraphError(f"node {name!r} is in no walk; add it to a walk or remove it")


def _check_acyclic(nodes: Mapping[str, Node], edges: Sequence[Edge]) -> None:
    successors: dict[str, list[str]] = {name: [] for name in nodes}
    for edge in edges:
        successors[edge.src_ref.node].append(edge.dst_ref.node)
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for nxt in successors[name]:
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise GraphError(
                    f"edges form a cycle outside a loop: {' -> '.join(cycle)}; feedback goes "
                    "through a Loop's carry= (output -> next iteration's input), not an edge"
                )
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[name] = 2

    for name in nodes:
        if name not in state:
            visit(name)
