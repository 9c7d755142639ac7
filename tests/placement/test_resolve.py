"""Each rule of a placement against a model, broken once; and what a valid one resolves to."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.errors import PlacementError
from mstar_async.graph import Model
from mstar_async.placement import Migration, Placement
from tests.placement.models import demo, shared_node, split_lm


@pytest.fixture(scope="module")
def model() -> Model:
    return demo()


def test_single_resolves_every_node_to_rank_zero(model: Model) -> None:
    r = Placement.single().validate(model)
    assert r.walks == {
        "prefill": {"prefill": (0,)},
        "speak": {"step": (0,), "codec": (0,)},
        "image": {"cond": (0,), "uncond": (0,), "guide": (0,), "vae": (0,)},
    }
    assert r.engines == {0: {"lm", "codec", "denoiser", "cfg", "vae"}}
    assert (r.devices, r.hosts, r.migrations, r.ranks) == ({0: "cpu"}, {0: None}, (), 1)
    assert r.engine_ranks["image"] == {"denoiser": (0,), "cfg": (0,), "vae": (0,)}


RULES: list[tuple[dict[str, Any], str]] = [
    ({"model": "causal-lm"}, "written for model 'causal-lm', not 'demo'"),
    ({"nodes": {"decoder": 0}}, "unknown node 'decoder'.*has nodes"),
    ({"walks": {"decode": {"step": 0}}}, "unknown walk 'decode'.*has walks"),
    ({"walks": {"prefill": {"codec": 0}}}, "walks.prefill names node 'codec'.*does not run"),
    ({"nodes": {"uncond": 1}}, "nodes 'cond'.*and 'uncond'.*share engine 'denoiser'"),
    (
        {"nodes": {"guide": 1}},
        r"walk 'image': its Loop over nodes \['cond', 'uncond', 'guide'\] spans ranks \('cond' "
        r"on rank 0, 'uncond' on rank 0, 'guide' on rank 1\); a loop lives on one rank.*place "
        "every node of the loop on the same rank",
    ),
    (
        {"nodes": {"prefill": [0, 1], "step": [1, 2]}},
        r"engine 'lm' runs on ranks \[0, 1\].*\[1, 2\].*overlap on \[1\]",
    ),
    ({"ranks": 3, "nodes": {"codec": 1}}, r"rank\(s\) \[2\] run no node"),
    (
        {"nodes": {"codec": 1}, "hosts": {1: "10.0.0.2"}},
        r"walk 'speak' cannot connect its nodes: edge step\.code ~> codec\.codes.*give rank 0",
    ),
]


@pytest.mark.parametrize(("data", "message"), RULES)
def test_each_rule_against_a_model(model: Model, data: dict[str, Any], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement.from_dict(data).validate(model)


def test_ranks_with_host_addresses_talk_over_tcp(model: Model) -> None:
    hosts = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.2"}
    r = Placement(nodes={"codec": 1, "vae": 2}, hosts=hosts).validate(model)
    assert (r.link(0, 0), r.link(0, 1), r.link(1, 2)) == ("memory", "tcp", "ipc")
    local = Placement(nodes={"codec": 1}).validate(model)
    assert local.link(0, 1) == "ipc"
    with pytest.raises(PlacementError, match="out of range"):
        local.link(0, 2)


def test_replicas_on_equal_ranks_keep_state_and_on_disjoint_ranks_move_it(model: Model) -> None:
    lm_replicas = Placement(nodes={"prefill": [1, 2], "step": [1, 2]}).validate(model)
    assert lm_replicas.migrations == ()
    assert lm_replicas.engine_ranks["speak"] == {"lm": (1, 2), "codec": (0,)}
    same = Placement(nodes={n: [0, 1] for n in model.nodes})
    assert same.validate(model).migrations == ()
    one_p_two_d = Placement(nodes={"step": [1, 2], "codec": [1, 2]}).validate(model)
    assert one_p_two_d.migrations == (Migration("lm", "prefill", "speak", (0,), (1, 2)),)
    assert one_p_two_d.engines == {
        0: {"lm", "denoiser", "cfg", "vae"},
        1: {"lm", "codec"},
        2: {"lm", "codec"},
    }


def test_one_node_serving_two_walks_is_split_per_walk() -> None:
    p = Placement(walks={"decode": {"lm": 1}})
    r = p.validate(shared_node())
    assert r.walks == {"prefill": {"lm": (0,)}, "decode": {"lm": (1,)}}
    assert r.engines == {0: {"lm"}, 1: {"lm"}}
    assert p.migrations(shared_node()) == [Migration("lm", "prefill", "decode", (0,), (1,))]
    assert p.engines_on(1, shared_node()) == {"lm"}


def test_migrations_follow_the_walk_order() -> None:
    r = Placement(nodes={"decode": 1}).validate(split_lm())
    forth = Migration("lm", "prefill", "decode", (0,), (1,))
    back = Migration("lm", "decode", "prefill", (1,), (0,))
    assert r.migrations_for() == [forth]
    assert r.migrations_for(["prefill", "decode", "prefill"]) == [forth, back]
    assert r.migrations_for(["decode"]) == []
    assert r.handoff("lm", "decode", "prefill") == back
    assert r.handoff("lm", "prefill", "prefill") is None
    assert r.handoff("codec", "prefill", "decode") is None
    with pytest.raises(PlacementError, match="no walk 'speak'"):
        r.migrations_for(["prefill", "speak"])


def test_a_migration_across_hosts_needs_both_addresses() -> None:
    # The first token crosses walks through the conductor, which reaches every rank; only
    # the KV move joins the two ranks directly.
    p = Placement(nodes={"decode": 1}, hosts={1: "10.0.0.2"})
    with pytest.raises(PlacementError, match="engine 'lm'.*cannot talk; give rank 0 a host"):
        p.validate(split_lm())
    Placement(nodes={"decode": 1}, hosts={0: "a", 1: "b"}).validate(split_lm())


def test_lookups_name_what_is_missing(model: Model) -> None:
    r = Placement.single().validate(model)
    assert r.ranks_for("speak", "codec") == (0,)
    with pytest.raises(PlacementError, match="walk 'speak' has no node 'vae'"):
        r.ranks_for("speak", "vae")
    with pytest.raises(PlacementError, match="no walk 'decode'"):
        r.ranks_for("decode", "vae")
    with pytest.raises(PlacementError, match="rank 1 is out of range"):
        r.engines_on(1)
