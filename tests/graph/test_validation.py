"""Each graph rule, broken once: the model refuses to build and the message names the culprit."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from mstar_async.errors import GraphError
from mstar_async.graph import (
    DynamicLoop,
    Edge,
    Loop,
    Model,
    Node,
    Parallel,
    Sequential,
    Walk,
    stream,
)
from mstar_async.policies import FixedChunkPolicy


async def _program(request: Any) -> AsyncIterator[Any]:
    yield None


def make_model(
    nodes: Sequence[Node], walks: Sequence[Walk], edges: Sequence[Edge] = (), **kw: Any
) -> Model:
    engines = {n.engine for n in nodes}
    return Model(
        "m",
        nodes=nodes,
        walks=walks,
        edges=edges,
        program=_program,
        components={e: object for e in engines},
        **kw,
    )


A = Node("a", engine="e", inputs=["x"], outputs=["y"])
B = Node("b", engine="e", inputs=["x"], outputs=["y"])
C = Node("c", engine="e", inputs=["x"], outputs=["y"])


def test_a_valid_model_builds_and_plans_each_walk() -> None:
    model = make_model([A, B], [Walk("w", Sequential("a", "b"))], [Edge("a.y", "b.x")])
    plan = model.plan("w")
    assert [str(p) for p in plan.outputs] == ["b.y"]
    assert [str(p) for p in plan.input_ports] == ["a.x"]


def test_edge_to_unknown_node_names_the_node() -> None:
    with pytest.raises(GraphError, match="unknown node 'ghost'"):
        make_model([A], [Walk("w", "a")], [Edge("a.y", "ghost.x")])


def test_edge_from_unknown_node_names_the_node() -> None:
    with pytest.raises(GraphError, match="unknown node 'ghost'"):
        make_model([A], [Walk("w", "a")], [Edge("ghost.y", "a.x")])


def test_walk_naming_unknown_node_fails() -> None:
    with pytest.raises(GraphError, match="unknown node 'nope'"):
        make_model([A], [Walk("w", Sequential("a", "nope"))])


def test_edge_without_consumer_port() -> None:
    with pytest.raises(GraphError, match=r"has no consumer: node 'b' has no input port 'z'"):
        make_model([A, B], [Walk("w", Sequential("a", "b"))], [Edge("a.y", "b.z")])


def test_edge_whose_consumer_is_in_no_walk() -> None:
    with pytest.raises(GraphError, match=r"has no consumer: node 'b' is in no walk"):
        make_model([A, B], [Walk("w", "a")], [Edge("a.y", "b.x")])


def test_edge_from_missing_output_port() -> None:
    with pytest.raises(GraphError, match="node 'a' has no output port 'q'"):
        make_model([A, B], [Walk("w", Sequential("a", "b"))], [Edge("a.q", "b.x")])


def test_cycle_outside_a_loop_names_the_cycle() -> None:
    with pytest.raises(GraphError, match=r"cycle outside a loop: a -> b -> a"):
        make_model(
            [A, B], [Walk("w1", "a"), Walk("w2", "b")], [Edge("a.y", "b.x"), Edge("b.y", "a.x")]
        )


def test_duplicate_node_name() -> None:
    with pytest.raises(GraphError, match="node name 'a' is used twice"):
        make_model([A, Node("a", engine="e")], [Walk("w", "a")])


def test_duplicate_walk_name() -> None:
    with pytest.raises(GraphError, match="walk name 'w' is used twice"):
        make_model([A], [Walk("w", "a"), Walk("w", "a")])


def test_node_used_twice_in_one_walk() -> None:
    with pytest.raises(GraphError, match=r"uses node\(s\) \['a'\] more than once"):
        make_model([A], [Walk("w", Sequential("a", "a"))])


def test_duplicate_port_name() -> None:
    with pytest.raises(GraphError, match="names an input port twice"):
        Node("n", engine="e", inputs=["x", "x"])


def test_two_edges_into_one_port() -> None:
    with pytest.raises(GraphError, match="fed by two edges"):
        make_model(
            [A, B, C],
            [Walk("w", Sequential("a", "b", "c"))],
            [Edge("a.y", "c.x"), Edge("b.y", "c.x")],
        )


def test_policy_on_a_non_streaming_edge() -> None:
    with pytest.raises(GraphError, match="has a chunk policy but is not streaming"):
        Edge("a.y", "b.x", policy=FixedChunkPolicy(2))


def test_streaming_edge_defaults_to_one_item_chunks() -> None:
    edge = stream("a.y", "b.x")
    assert edge.streaming and edge.policy == FixedChunkPolicy(1)


def test_walk_with_no_node() -> None:
    with pytest.raises(GraphError, match="walk 'empty' names no node"):
        make_model([A], [Walk("w", "a"), Walk("empty", Sequential())])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_loop_bounds_below_one(bad: Any) -> None:
    with pytest.raises(GraphError, match="Loop iterations must be an int >= 1"):
        Loop("a", iterations=bad)


@pytest.mark.parametrize("bad", [0, -3])
def test_dynamic_loop_bound_below_one(bad: int) -> None:
    with pytest.raises(GraphError, match="max_iterations must be an int >= 1"):
        DynamicLoop("a", until=lambda s: True, max_iterations=bad)


def test_node_in_no_walk() -> None:
    with pytest.raises(GraphError, match="node 'b' is in no walk"):
        make_model([A, B], [Walk("w", "a")])


def test_node_naming_an_undefined_engine() -> None:
    with pytest.raises(GraphError, match="names engine 'e', which the model does not define"):
        Model("m", nodes=[A], walks=[Walk("w", "a")], program=_program, components={})


def test_edge_backwards_in_a_sequential() -> None:
    with pytest.raises(GraphError, match="runs backwards in a Sequential"):
        make_model([A, B], [Walk("w", Sequential("b", "a"))], [Edge("a.y", "b.x")])


def test_edge_between_parallel_branches() -> None:
    with pytest.raises(GraphError, match="connects two Parallel branches"):
        make_model([A, B], [Walk("w", Parallel("a", "b"))], [Edge("a.y", "b.x")])


def test_bad_port_reference() -> None:
    with pytest.raises(GraphError, match="must look like 'node.port'"):
        Edge("a", "b.x")


def test_carry_naming_a_port_outside_the_body() -> None:
    loop = Loop("a", iterations=2, carry={"b.y": "a.x"})
    with pytest.raises(
        GraphError, match="carry source b.y is not an output port of a node in the loop body"
    ):
        make_model([A, B], [Walk("w", Sequential(loop, "b"))])


def test_port_fed_by_edge_and_carry() -> None:
    loop = Loop(Sequential("a", "b"), iterations=2, carry={"b.y": "b.x"})
    with pytest.raises(GraphError, match="fed both by edge"):
        make_model([A, B], [Walk("w", loop)], [Edge("a.y", "b.x")])


def test_node_with_two_streaming_inputs() -> None:
    two = Node("two", engine="e", inputs=["p", "q"])
    with pytest.raises(GraphError, match="takes 2 streaming inputs"):
        make_model(
            [A, B, two],
            [Walk("w", Sequential(Parallel("a", "b"), "two"))],
            [stream("a.y", "two.p"), stream("b.y", "two.q")],
        )


def test_invalid_names() -> None:
    with pytest.raises(GraphError, match="node name 'a.b' is invalid"):
        Node("a.b", engine="e")


def test_explicit_output_must_belong_to_the_walk() -> None:
    with pytest.raises(GraphError, match="output b.y is not an output port of a node in this walk"):
        make_model([A, B], [Walk("w", "a", outputs=["b.y"]), Walk("v", "b")])


def test_unknown_walk_lookup_lists_walks() -> None:
    model = make_model([A], [Walk("w", "a")])
    with pytest.raises(GraphError, match=r"has no walk 'x'; its walks are \['w'\]"):
        model.plan("x")


def test_plan_marks_streams_leaving_a_loop_as_pipelined() -> None:
    loop = DynamicLoop("a", until=lambda s: True, max_iterations=4, carry={"a.y": "a.x"})
    walk = Walk("w", Sequential(loop, "b"))
    model = make_model([A, B], [walk], [stream("a.y", "b.x")])
    plan = model.plan("w")
    assert plan.pipelined[walk.body] == (False, True)  # type: ignore[index]
    (edge,) = plan.edges
    assert edge.lca is None and edge.export_loop is loop and edge.import_loop is None


def test_a_loop_outliving_streams_must_read_one() -> None:
    alone = DynamicLoop("b", until=lambda s: True, max_iterations=4, outlives_streams=True)
    with pytest.raises(
        GraphError, match=r"DynamicLoop over \['b'\] has outlives_streams=True but reads no stream"
    ):
        make_model([A, B], [Walk("w", Sequential("a", alone))], [Edge("a.y", "b.x")])
    # Reading a stream from before the loop, it builds.
    reader = DynamicLoop("b", until=lambda s: True, max_iterations=4, outlives_streams=True)
    model = make_model([A, B], [Walk("w", Sequential("a", reader))], [stream("a.y", "b.x")])
    (edge,) = model.plan("w").edges
    assert edge.import_loop is reader
