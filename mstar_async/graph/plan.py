"""What the conductor needs to know about one walk, worked out once when the model is built.

Every value lives in a *scope*: the walk's top level, or one iteration of a loop. An edge's
runtime object (a value cell or a streaming channel) lives in the scope of the innermost loop
that holds both its ends (its ``lca``). A value leaving a loop is published to that scope on every
iteration (``export_loop`` is the loop it leaves); a value entering a loop is read once when the
loop starts, or one chunk per iteration for a streaming edge (``import_loop`` is the loop it
enters). Working this out here keeps the runner a small interpreter with no graph search in it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from mstar_async.errors import GraphError
from mstar_async.graph.blocks import (
    AnyLoop,
    Block,
    DynamicLoop,
    Loop,
    NodeRef,
    Parallel,
    Sequential,
    Walk,
    children,
    node_names,
)
from mstar_async.graph.nodes import Edge, Node, PortRef
from mstar_async.policies import ChunkPolicy


@dataclass(frozen=True, eq=False)
class EdgePlan:
    """One edge of a walk, with the scopes its value crosses."""

    edge: Edge
    lca: AnyLoop | None
    export_loop: AnyLoop | None
    import_loop: AnyLoop | None

    @property
    def src(self) -> PortRef:
        return self.edge.src_ref

    @property
    def dst(self) -> PortRef:
        return self.edge.dst_ref

    @property
    def streaming(self) -> bool:
        return self.edge.streaming


@dataclass
class WalkPlan:
    """The facts the conductor's walk runner reads; built by ``plan_walk``."""

    walk: Walk
    nodes: dict[str, Node]
    loop_of: dict[str, AnyLoop | None]
    edges: list[EdgePlan]
    in_edge: dict[PortRef, EdgePlan]
    out_edges: dict[PortRef, list[EdgePlan]]
    persisted_in: dict[PortRef, PortRef]
    persisted_out: frozenset[PortRef]
    outputs: tuple[PortRef, ...]
    input_ports: dict[PortRef, None]
    #: Walk inputs that arrive as a stream (``Walk.streams``): port -> the policy template.
    input_streams: dict[PortRef, ChunkPolicy] = field(default_factory=dict)
    scope_edges: dict[AnyLoop | None, list[EdgePlan]] = field(default_factory=dict)
    loop_imports: dict[AnyLoop, list[EdgePlan]] = field(default_factory=dict)
    finalize_after: dict[Block, list[EdgePlan]] = field(default_factory=dict)
    pipelined: dict[Sequential, tuple[bool, ...]] = field(default_factory=dict)

    def stream_input(self, node: str) -> EdgePlan | None:
        """The streaming edge a node consumes chunk by chunk in its own scope, if any."""
        for port in self.nodes[node].inputs:
            plan = self.in_edge.get(PortRef(node, port))
            if plan is not None and plan.streaming and plan.import_loop is None:
                return plan
        return None


def _loop_chains(
    block: Block, chain: tuple[AnyLoop, ...], out: dict[str, tuple[AnyLoop, ...]]
) -> None:
    if isinstance(block, NodeRef):
        out[block.name] = chain
        return
    inner = (*chain, block) if isinstance(block, Loop | DynamicLoop) else chain
    for child in children(block):
        _loop_chains(child, inner, out)


def _edge_plan(edge: Edge, chains: Mapping[str, tuple[AnyLoop, ...]]) -> EdgePlan:
    src, dst = chains[edge.src_ref.node], chains[edge.dst_ref.node]
    common = 0
    while common < min(len(src), len(dst)) and src[common] is dst[common]:
        common += 1
    return EdgePlan(
        edge=edge,
        lca=src[common - 1] if common else None,
        export_loop=src[common] if len(src) > common else None,
        import_loop=dst[common] if len(dst) > common else None,
    )


def _check_order(
    walk: Walk, block: Block, plans: list[EdgePlan], pipelined: dict[Sequential, tuple[bool, ...]]
) -> None:
    """Sequential edges must run forward; Parallel branches may not feed each other."""
    if isinstance(block, Sequential | Parallel):
        position = {
            name: i for i, child in enumerate(children(block)) for name in node_names(child)
        }
        streams_from_earlier = [False] * len(children(block))
        for plan in plans:
            a, b = position.get(plan.src.node), position.get(plan.dst.node)
            if a is None or b is None or a == b:
                continue
            if isinstance(block, Parallel):
                raise GraphError(
                    f"walk {walk.name!r}: edge {plan.edge} connects two Parallel branches; "
                    "branches run concurrently and may not feed each other (move the consumer "
                    "after the Parallel in a Sequential)"
                )
            if a > b:
                raise GraphError(
                    f"walk {walk.name!r}: edge {plan.edge} runs backwards in a Sequential "
                    f"(child {a} feeds child {b}); reorder the children, or use a Loop with carry= "
                    "for feedback"
                )
            if plan.streaming:
                # Every child from the producer's successor up to the consumer must start
                # without waiting for the producer to finish, or a full buffer would deadlock.
                for k in range(a + 1, b + 1):
                    streams_from_earlier[k] = True
        if isinstance(block, Sequential):
            pipelined[block] = tuple(streams_from_earlier)
    for child in children(block):
        _check_order(walk, child, plans, pipelined)


def _check_carries(
    walk: Walk, block: Block, nodes: Mapping[str, Node], in_edge: Mapping[PortRef, EdgePlan]
) -> None:
    if isinstance(block, Loop | DynamicLoop):
        inside = set(node_names(block.body))
        for src, dsts in block.carry.items():
            if src.node not in inside or src.port not in nodes[src.node].outputs:
                raise GraphError(
                    f"walk {walk.name!r}: carry source {src} is not an output port "
                    "of a node in the loop body"
                )
            for dst in dsts:
                if dst.node not in inside or dst.port not in nodes[dst.node].inputs:
                    raise GraphError(
                        f"walk {walk.name!r}: carry target {dst} is not an input port "
                        "of a node in the loop body"
                    )
                fed = in_edge.get(dst)
                if fed is not None and fed.src.node in inside:
                    raise GraphError(
                        f"walk {walk.name!r}: {dst} is fed both by edge {fed.edge} "
                        "and by the loop's "
                        "carry; drop one of them"
                    )
    for child in children(block):
        _check_carries(walk, child, nodes, in_edge)


def _default_outputs(
    walk: Walk, nodes: Mapping[str, Node], consumed: set[PortRef]
) -> tuple[PortRef, ...]:
    return tuple(
        PortRef(name, port)
        for name in node_names(walk.body)
        for port in nodes[name].outputs
        if PortRef(name, port) not in consumed
    )


def _explicit_outputs(walk: Walk, nodes: Mapping[str, Node]) -> tuple[PortRef, ...]:
    refs = tuple(PortRef.parse(o, role=f"walk {walk.name!r} output") for o in walk.outputs or ())
    for ref in refs:
        if ref.node not in nodes or ref.port not in nodes[ref.node].outputs:
            raise GraphError(
                f"walk {walk.name!r}: output {ref} is not an output port of a node in this walk"
            )
    return refs


def _finalizers(plan: WalkPlan) -> dict[Block, list[EdgePlan]]:
    """Which edges close (their value is final, their stream ends) when a block finishes."""
    refs: dict[str, NodeRef] = {}
    stack: list[Block] = [plan.walk.body]
    while stack:
        block = stack.pop()
        if isinstance(block, NodeRef):
            refs[block.name] = block
        stack.extend(children(block))
    result: dict[Block, list[EdgePlan]] = defaultdict(list)
    for edge in plan.edges:
        owner: Block = edge.export_loop if edge.export_loop is not None else refs[edge.src.node]
        result[owner].append(edge)
    return dict(result)


def _is_stream(edge: EdgePlan | None) -> bool:
    return edge is not None and edge.streaming


def _input_streams(
    walk: Walk,
    nodes: Mapping[str, Node],
    chains: Mapping[str, tuple[AnyLoop, ...]],
    input_ports: Mapping[PortRef, None],
    in_edge: Mapping[PortRef, EdgePlan],
) -> dict[PortRef, ChunkPolicy]:
    streams: dict[PortRef, ChunkPolicy] = {}
    for name, policy in walk.streams:
        ref = PortRef.parse(name, role=f"walk {walk.name!r} stream")
        if ref not in input_ports:
            raise GraphError(
                f"walk {walk.name!r}: stream {ref} is not a free input port of the walk "
                f"(free inputs: {sorted(str(r) for r in input_ports)})"
            )
        if chains[ref.node]:
            raise GraphError(
                f"walk {walk.name!r}: stream {ref} feeds a node inside a loop; a streamed walk "
                "input feeds a node outside loops, which fires once per chunk"
            )
        if any(_is_stream(in_edge.get(PortRef(ref.node, p))) for p in nodes[ref.node].inputs):
            raise GraphError(
                f"walk {walk.name!r}: node {ref.node!r} takes stream {ref} and a streaming "
                "edge; a node consumes at most one stream"
            )
        if not isinstance(policy, ChunkPolicy):
            raise GraphError(
                f"walk {walk.name!r}: stream {ref} needs a ChunkPolicy, got {policy!r}"
            )
        streams[ref] = policy
    return streams


def _check_outliving(walk: Walk, plan: WalkPlan, chains: Mapping[str, tuple[AnyLoop, ...]]) -> None:
    loops = {loop for chain in chains.values() for loop in chain}
    for loop in loops:
        reads = any(e.streaming for e in plan.loop_imports.get(loop, ()))
        if isinstance(loop, DynamicLoop) and loop.outlives_streams and not reads:
            names = sorted(set(node_names(loop.body)))
            raise GraphError(
                f"walk {walk.name!r}: the DynamicLoop over {names} has outlives_streams=True but "
                "reads no stream from outside it; drop outlives_streams"
            )


def plan_walk(walk: Walk, graph_nodes: Mapping[str, Node], graph_edges: list[Edge]) -> WalkPlan:
    """Check one walk against the graph and work out its scopes.

    Raises:
        GraphError: the walk names no node, an unknown node or one node twice; an edge runs
            backwards in a Sequential or joins Parallel branches; a node takes two streams; a
            carry or output names a port outside the walk; a loop that outlives its streams
            reads none.
    """
    names = node_names(walk.body)
    if not names:
        raise GraphError(f"walk {walk.name!r} names no node; give it at least one node")
    for name in names:
        if name not in graph_nodes:
            raise GraphError(
                f"walk {walk.name!r} names unknown node {name!r}; "
                f"known nodes: {sorted(graph_nodes)}"
            )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise GraphError(
            f"walk {walk.name!r} uses node(s) {repeated} more than once; "
            "a node appears once per walk"
        )
    nodes = {name: graph_nodes[name] for name in names}
    chains: dict[str, tuple[AnyLoop, ...]] = {}
    _loop_chains(walk.body, (), chains)

    edges: list[EdgePlan] = []
    persisted_in: dict[PortRef, PortRef] = {}
    persisted_out: set[PortRef] = set()
    for edge in graph_edges:
        src_in, dst_in = edge.src_ref.node in nodes, edge.dst_ref.node in nodes
        if src_in and dst_in:
            edges.append(_edge_plan(edge, chains))
        elif dst_in:
            persisted_in[edge.dst_ref] = edge.src_ref
        elif src_in:
            persisted_out.add(edge.src_ref)
    in_edge = {e.dst: e for e in edges}
    out_edges: dict[PortRef, list[EdgePlan]] = defaultdict(list)
    for e in edges:
        out_edges[e.src].append(e)

    for name, node in nodes.items():
        streams = [p for p in node.inputs if _is_stream(in_edge.get(PortRef(name, p)))]
        if len(streams) > 1:
            raise GraphError(
                f"walk {walk.name!r}: node {name!r} takes {len(streams)} streaming inputs "
                f"{streams}; "
                "a node consumes at most one stream (merge them upstream)"
            )
    pipelined: dict[Sequential, tuple[bool, ...]] = {}
    _check_order(walk, walk.body, edges, pipelined)
    _check_carries(walk, walk.body, nodes, in_edge)

    consumed = {e.src for e in edges} | persisted_out
    outputs = (
        _explicit_outputs(walk, nodes)
        if walk.outputs is not None
        else _default_outputs(walk, nodes, consumed)
    )
    input_ports = {
        PortRef(name, port): None
        for name, node in nodes.items()
        for port in node.inputs
        if PortRef(name, port) not in in_edge
    }
    input_streams = _input_streams(walk, nodes, chains, input_ports, in_edge)
    plan = WalkPlan(
        walk=walk,
        nodes=nodes,
        loop_of={name: chain[-1] if chain else None for name, chain in chains.items()},
        edges=edges,
        in_edge=in_edge,
        out_edges=dict(out_edges),
        persisted_in=persisted_in,
        persisted_out=frozenset(persisted_out),
        outputs=outputs,
        input_ports=input_ports,
        input_streams=input_streams,
        pipelined=pipelined,
    )
    for e in edges:
        plan.scope_edges.setdefault(e.lca, []).append(e)
        if e.import_loop is not None:
            plan.loop_imports.setdefault(e.import_loop, []).append(e)
    plan.finalize_after = _finalizers(plan)
    _check_outliving(walk, plan, chains)
    return plan
