"""A split walk's outputs reach the program in the walk's order, whatever order the ranks'
updates arrive in: an output made after another rank's unit finished waits for that unit's
outputs (``SegmentedWalk``'s marks; the updates are fed here in the orders ZeroMQ may deliver)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mstar_async.graph import PortRef
from mstar_async.transport import AFTER_UNIT, UNIT_DONE
from mstar_async.worker.segmented import SegmentedWalk

pytestmark = pytest.mark.timeout(10)


class _Sink:
    def __init__(self) -> None:
        self.outputs: list[tuple[str, Any]] = []
        self.ended: tuple[dict[PortRef, Any], BaseException | None] | None = None

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.outputs.append((port, value))

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.ended = (persisted, error)


def _walk() -> tuple[SegmentedWalk, _Sink]:
    sink = _Sink()
    split: Any = SimpleNamespace(ranks=(0, 1))
    return SegmentedWalk(pool=None, split=split, sink=sink), sink  # type: ignore[arg-type]


# Rank 1 runs ``sink`` (unit 0) and tells rank 0 directly; rank 0 runs ``tail`` after it.
SINK_RANK = [("sink.out", 1), ("sink.out", 2), (UNIT_DONE, 0)]
TAIL_RANK = [(AFTER_UNIT, [1, 0]), ("tail.z", 1002)]
IN_ORDER = [("sink.out", 1), ("sink.out", 2), ("tail.z", 1002)]


@pytest.mark.parametrize(
    "arrivals",
    [
        # Rank 0's update first: its output waits for rank 1's.
        [(0, e) for e in TAIL_RANK] + [(1, e) for e in SINK_RANK],
        # Interleaved: one of rank 1's outputs is in, the other is not yet.
        [(1, SINK_RANK[0]), (0, TAIL_RANK[0]), (0, TAIL_RANK[1])] + [(1, e) for e in SINK_RANK[1:]],
        # The order of causes.
        [(1, e) for e in SINK_RANK] + [(0, e) for e in TAIL_RANK],
    ],
    ids=["later-rank-first", "interleaved", "in-order"],
)
def test_outputs_after_another_ranks_unit_wait_for_its_outputs(
    arrivals: list[tuple[int, tuple[str, Any]]],
) -> None:
    walk, sink = _walk()
    for rank, (port, value) in arrivals:
        walk.parts[rank].emit(port, value, 0)
    assert sink.outputs == IN_ORDER
    # The marks take no credit: each passed output is acknowledged to the rank that made it.
    assert [part.rank for part in walk._readers] == [1, 1, 0]
    for rank in (0, 1):
        walk.parts[rank].end({}, None)
    assert sink.ended == ({}, None)


def test_an_output_waiting_on_a_unit_holds_the_later_ones_of_its_rank() -> None:
    walk, sink = _walk()
    for port, value in [*TAIL_RANK, ("tail.z", 1003)]:
        walk.parts[0].emit(port, value, 0)
    assert sink.outputs == []
    for port, value in SINK_RANK:
        walk.parts[1].emit(port, value, 0)
    assert sink.outputs == [*IN_ORDER, ("tail.z", 1003)]
