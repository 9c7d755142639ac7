"""Placement as data: construction, the YAML/dict round trip, and the checks that need no model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mstar_async.errors import PlacementError
from mstar_async.placement import Placement


def test_single_puts_everything_on_rank_zero() -> None:
    p = Placement.single()
    assert (p.ranks, dict(p.nodes), dict(p.walks), p.model) == (1, {}, {}, None)
    assert p.ranks_for("any", "node") == (0,)
    assert p.to_dict() == {"ranks": 1}


def test_ranks_normalized_sorted_and_resolved_with_overrides_first() -> None:
    p = Placement(ranks=3, nodes={"codec": [2, 1], "vae": 1}, walks={"decode": {"lm": 2}})
    assert p.nodes == {"codec": (1, 2), "vae": (1,)}
    assert p.walks == {"decode": {"lm": (2,)}}
    assert p.ranks_for("decode", "lm") == (2,)
    assert p.ranks_for("prefill", "lm") == (0,)
    assert p.ranks_for("speak", "codec") == (1, 2)


def test_ranks_default_to_one_past_the_highest_rank_named() -> None:
    assert Placement(nodes={"codec": [1, 2]}).ranks == 3
    assert Placement(walks={"decode": {"decode": 1}}).ranks == 2
    assert Placement(devices={3: "cpu"}).ranks == 4
    assert Placement().ranks == 1


def test_dict_and_yaml_round_trip_and_equality() -> None:
    data = {
        "model": "demo",
        "ranks": 3,
        "nodes": {"codec": [1, 2], "vae": 1},
        "walks": {"speak": {"step": 0}},
        "devices": {0: "cpu", 1: "cuda:0", 2: "cuda:1"},
        "hosts": {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.2"},
    }
    p = Placement.from_dict(data)
    assert p.to_dict() == data
    assert Placement.from_yaml(p.to_yaml()) == p
    assert hash(Placement.from_dict(data)) == hash(p)
    assert Placement.from_dict({"devices": {"1": "cpu"}}).devices == {1: "cpu"}


def test_from_yaml_reads_text_and_files(tmp_path: Path) -> None:
    text = "ranks: 2\nnodes:\n  codec: 1\ndevices: {0: cpu, 1: 'cuda:0'}\n"
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert Placement.from_yaml(text) == Placement.from_yaml(path)
    assert Placement.from_yaml(path).devices == {0: "cpu", 1: "cuda:0"}
    assert Placement.from_yaml("") == Placement.single()
    assert Placement.from_yaml("# nothing\n") == Placement.single()


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12", "mps", "xpu:1"])
def test_accepted_devices(device: str) -> None:
    assert Placement(devices={0: device}).devices == {0: device}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"ranks": 0}, "ranks must be an int >= 1"),
    ({"ranks": "two"}, "ranks must be an int >= 1"),
    ({"ranks": True}, "ranks must be an int >= 1"),
    ({"ranks": 2, "nodes": {"codec": 2}}, r"nodes\.codec names rank 2, but ranks is 2"),
    ({"ranks": 2, "nodes": {"codec": -1}}, r"nodes\.codec names rank -1"),
    ({"ranks": 2, "walks": {"d": {"x": [0, 5]}}}, r"walks\.d\.x names rank 5"),
    ({"nodes": {"codec": [1, 1]}}, r"lists rank\(s\) \[1\] twice"),
    ({"nodes": {"codec": []}}, "lists no rank"),
    ({"nodes": {"codec": True}}, "must be a rank or a list of ranks"),
    ({"nodes": {"codec": "1"}}, "must be a rank or a list of ranks"),
    ({"nodes": {"codec": [1.5]}}, r"rank 1\.5 is not an int"),
    ({"nodes": {"": 0}}, "node name must be a non-empty string"),
    ({"devices": {0: "gpu"}}, r"devices\.0 is 'gpu'.*cpu, cuda, cuda:N, mps or xpu"),
    ({"devices": {0: "cuda:x"}}, r"devices\.0 is 'cuda:x'"),
    ({"devices": {0: "cuda:01"}}, r"devices\.0 is 'cuda:01'"),
    ({"ranks": 1, "devices": {1: "cpu"}}, r"devices names rank 1, but ranks is 1"),
    ({"devices": {"zero": "cpu"}}, "devices keys must be ranks"),
    ({"hosts": {0: "my host"}}, r"hosts\.0 is 'my host'"),
    ({"hosts": {0: ""}}, r"hosts\.0 is ''"),
    ({"rank": 2}, r"unknown key\(s\) \['rank'\]"),
    ({"nodes": [1, 2]}, "nodes must be a mapping"),
    ({"walks": {"decode": 1}}, r"walks\.decode must map node names to ranks"),
    ({"model": 3}, "model name must be a non-empty string"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_each_rule_without_a_model(data: dict[str, Any], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement.from_dict(data)


def test_yaml_errors_name_the_source(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="not valid YAML"):
        Placement.from_yaml("nodes: [1,\n")
    with pytest.raises(PlacementError, match="pass a pathlib.Path"):
        Placement.from_yaml("examples/placements/single.yaml")
    with pytest.raises(PlacementError, match="cannot read placement file"):
        Placement.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ranks: 1\nnodes: {codec: 1}\n")
    with pytest.raises(PlacementError, match=r"bad\.yaml: placement: nodes\.codec names rank 1"):
        Placement.from_yaml(bad)
    with pytest.raises(PlacementError, match="must be a mapping"):
        Placement.from_yaml("[1, 2]")


def test_strategy_and_resources_round_trip_and_default() -> None:
    data = {
        "model": "orpheus",
        "ranks": 2,
        "nodes": {"codec": 1},
        "strategy": "SPREAD",
        "resources": {0: {"CPU": 2}, 1: {"GPU": 1, "memory": 2**30, "node_b": 0.5}},
    }
    p = Placement.from_dict(data)
    assert p.to_dict() == data
    assert Placement.from_yaml(p.to_yaml()) == p
    assert hash(Placement.from_dict(data)) == hash(p)
    assert p.resources_for(0) == {"CPU": 2}
    assert p.resources_for(1) == {"CPU": 1, "GPU": 1, "memory": 2**30, "node_b": 0.5}
    plain = Placement(nodes={"codec": 1})
    assert (plain.strategy, dict(plain.resources)) == ("PACK", {})
    assert plain.resources_for(1) == {"CPU": 1}
    assert "strategy" not in plain.to_dict() and "resources" not in plain.to_dict()
    assert Placement.from_yaml("strategy: spread\n").strategy == "SPREAD"
    assert Placement(resources={0: {"CPU": 0, "GPU": 1}}).resources_for(0) == {"GPU": 1}
    assert Placement.from_dict({"resources": {"2": {"CPU": 1}}}).ranks == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"strategy": "FAST"}, r"strategy is 'FAST'; write one of PACK, SPREAD"),
        ({"strategy": 3}, "strategy is 3"),
        ({"resources": [1]}, "resources must be a mapping"),
        ({"resources": {1: 2}}, r"resources\.1 must map resource names to amounts"),
        ({"resources": {1: {"GPU": -1}}}, r"resources\.1\.GPU is -1; write a number >= 0"),
        ({"resources": {1: {"GPU": "one"}}}, r"resources\.1\.GPU is 'one'"),
        ({"resources": {1: {"GPU": True}}}, r"resources\.1\.GPU is True"),
        ({"resources": {1: {"gpu": 1}}}, r"resources\.1\.gpu: .*case-sensitive; write GPU"),
        ({"resources": {0: {"": 1}}}, "resource name ''"),
        ({"resources": {0: {"CPU": 0}}}, r"resources\.0 asks for nothing"),
        ({"resources": {"x": {"CPU": 1}}}, "resources keys must be ranks"),
        ({"ranks": 2, "resources": {2: {"CPU": 1}}}, "resources names rank 2, but ranks is 2"),
    ],
)
def test_bad_strategy_or_resources_name_the_key_and_the_fix(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement.from_dict(data)
