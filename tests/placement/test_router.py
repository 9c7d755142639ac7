"""ReplicaRouter: least loaded, lowest rank on a tie, sticky per request and engine, pinned
where asked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.placement import ReplicaRouter, Route


def test_least_loaded_then_lowest_rank() -> None:
    router = ReplicaRouter()
    assert router.route("a", "codec", [2, 1]) == Route(1)
    assert router.route("b", "codec", [1, 2]) == Route(2)
    assert router.route("c", "codec", [1, 2]) == Route(1)
    assert router.loads == {1: 2, 2: 1}


def test_sticky_until_finish() -> None:
    router = ReplicaRouter()
    router.route("a", "codec", [1, 2])
    router.route("b", "codec", [1, 2])
    router.finish("b")
    router.route("c", "codec", [1, 2])  # rank 2 is free again
    assert router.rank_of("c", "codec") == 2
    assert router.route("a", "codec", [1, 2]) == Route(1)  # a stays, though ranks now tie
    router.finish("a")
    router.finish("a")  # idempotent
    assert router.loads == {2: 1}
    assert router.rank_of("a", "codec") is None


def test_a_request_counts_once_per_rank() -> None:
    router = ReplicaRouter()
    router.route("a", "lm", [0])
    router.route("a", "denoiser", [0])
    assert router.loads == {0: 1}
    router.finish("a")
    assert router.loads == {}


def test_leaving_the_ranks_moves_the_state() -> None:
    router = ReplicaRouter()
    router.route("x", "lm", [1])  # another request makes rank 1 busier
    assert router.route("a", "lm", [0]) == Route(0)
    assert router.route("a", "lm", [1, 2]) == Route(2, moved_from=0)
    assert router.loads == {1: 1, 2: 1}
    assert router.route("a", "lm", [1, 2]) == Route(2)


def test_given_loads_replace_the_routers_own() -> None:
    router = ReplicaRouter()
    assert router.route("a", "codec", [1, 2], loads={1: 5, 2: 3}) == Route(2)
    assert router.route("b", "codec", [1, 2], loads={2: 1}) == Route(1)


def test_a_pinned_request_goes_to_its_rank_whatever_the_loads() -> None:
    router = ReplicaRouter()
    router.route("a", "talker", [0, 1])
    router.pin("b", "talker", 0)  # rank 0 is the busier one
    assert router.route("b", "talker", [0, 1]) == Route(0)
    assert router.loads == {0: 2}
    router.pin("b", "talker", 0)  # the same pin again changes nothing
    with pytest.raises(ValueError, match="already runs engine 'talker' on rank 0"):
        router.pin("b", "talker", 1)
    router.finish("b")
    assert router.loads == {0: 1}


def test_no_ranks_is_an_argument_error() -> None:
    with pytest.raises(ValueError, match="no ranks"):
        ReplicaRouter().route("a", "codec", [])


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.integers(0, 5), st.sampled_from(["lm", "codec"])),
        st.tuples(st.just("finish"), st.integers(0, 5), st.just("")),
        st.tuples(st.just("pin"), st.integers(0, 5), st.sampled_from(["lm", "codec"])),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.sets(st.integers(0, 3), min_size=1))
def test_loads_always_match_the_assignments(
    ops: list[tuple[str, int, str]], ranks: set[int]
) -> None:
    router = ReplicaRouter()
    live: dict[str, dict[str, int]] = {}
    for op, n, engine in ops:
        rid = f"r{n}"
        if op == "finish":
            router.finish(rid)
            live.pop(rid, None)
            continue
        before = router.loads
        had = router.rank_of(rid, engine)
        if op == "pin":
            rank = max(ranks) if had is None else had
            router.pin(rid, engine, rank)
            live.setdefault(rid, {})[engine] = rank
            continue
        rank = router.route(rid, engine, sorted(ranks)).rank
        if had is None:
            best = min((before.get(r, 0), r) for r in ranks)
            assert (before.get(rank, 0), rank) == best
        else:
            assert rank == had
        live.setdefault(rid, {})[engine] = rank
    expected: dict[int, int] = {}
    for held in live.values():
        for rank in set(held.values()):
            expected[rank] = expected.get(rank, 0) + 1
    assert router.loads == expected
