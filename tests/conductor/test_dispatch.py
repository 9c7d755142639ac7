"""Where ``PlacedExecutor`` runs each walk of a request: the rank of its nodes, the state it
names to move there first, and what it releases; no worker process is involved."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import pytest

from mstar_async.conductor.dispatch import PlacedExecutor
from mstar_async.conductor.walk_stream import WalkControl, WalkInbox
from mstar_async.engines import StatelessEngine
from mstar_async.errors import PlacementError
from mstar_async.graph import DynamicLoop, Model, Node, PortRef, Sequential, Walk
from mstar_async.placement import Placement

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


async def _program(request: Any) -> AsyncGenerator[Any, None]:
    yield None


def _lm() -> Model:
    """Prefill and a decode loop over one engine, as the causal-lm has them."""
    nodes = [
        Node("prefill", engine="e", op="id", inputs=["x"], outputs=["y"]),
        Node("decode", engine="e", op="id", inputs=["x"], outputs=["y"]),
        Node("sample", engine="s", op="id", inputs=["x"], outputs=["y"]),
    ]
    loop = DynamicLoop(
        Sequential("decode", "sample"),
        until=lambda s: True,
        max_iterations=4,
        carry={"sample.y": "decode.x"},
    )
    walks = [Walk("prefill", "prefill", outputs=["prefill.y"]), Walk("decode", loop)]
    engine = lambda: StatelessEngine({"id": lambda x: {"y": x}})  # noqa: E731
    return Model(
        "lm", nodes=nodes, walks=walks, program=_program, components={"e": engine, "s": engine}
    )


class Ranks:
    """A ``RankExecutor`` that records what it is asked and starts nothing."""

    def __init__(self) -> None:
        self.opened: list[tuple[int, str, dict[str, int]]] = []
        self.released: list[tuple[int, str]] = []

    async def release_on(self, rank: int, request_id: str) -> None:
        self.released.append((rank, request_id))

    def open_walk_on(
        self,
        rank: int,
        request_id: str,
        walk: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkInbox,
        *,
        moves: Mapping[str, int] | None = None,
    ) -> WalkControl:
        self.opened.append((rank, walk, dict(moves or {})))
        return None  # type: ignore[return-value]

    def open_segments(self, *args: Any, **kwargs: Any) -> WalkControl:
        raise AssertionError("these walks run on one rank each")


def _open(executor: PlacedExecutor, model: Model, request_id: str, walk: str) -> WalkInbox:
    sink = WalkInbox()
    executor.open_walk(request_id, model.plan(walk), {}, {}, {}, sink)
    return sink


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_decode_rank_is_told_to_take_the_state_once_and_both_ranks_are_released() -> None:
    model = _lm()
    placement = Placement(walks={"decode": {"decode": 1, "sample": 1}}).validate(model)
    ranks = Ranks()
    executor = PlacedExecutor(placement, ranks)
    _open(executor, model, "r", "prefill")
    _open(executor, model, "r", "decode")
    _open(executor, model, "r", "decode")  # the state is on rank 1 now: nothing moves
    _open(executor, model, "q", "decode")  # another request never prefilled: nothing to move
    assert ranks.opened == [
        (0, "prefill", {}),
        (1, "decode", {"e": 0}),
        (1, "decode", {}),
        (1, "decode", {}),
    ]
    await executor.release("r")
    assert ranks.released == [(0, "r"), (1, "r")]
    _open(executor, model, "r", "decode")  # a new request of that id starts afresh
    assert ranks.opened[-1] == (1, "decode", {})


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_loop_that_replicas_split_ends_its_walk_with_a_placement_error() -> None:
    model = _lm()
    # decode and sample use two engines on the same two replicas: valid, but each engine is
    # routed on its own, so a request may get its loop across both ranks.
    replicas = [0, 1]
    placement = Placement(
        nodes={"prefill": replicas, "decode": replicas, "sample": replicas}
    ).validate(model)
    ranks = Ranks()
    executor = PlacedExecutor(placement, ranks)
    executor.router.pin("r", "e", 0)
    executor.router.pin("r", "s", 1)
    sink = _open(executor, model, "r", "decode")
    assert sink.ended and isinstance(sink.error, PlacementError)
    assert "a loop would span ranks for this request" in str(sink.error)
    assert ranks.opened == []
