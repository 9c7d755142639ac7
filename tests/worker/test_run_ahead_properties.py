"""Random mixes of looping walks on one worker, with steps run ahead of their walks: loops that
stop at different counts, at their iteration limit, small output windows read slowly, cancels at
random points, forwards on the thread or inline. Every walk makes exactly its outputs (a prefix
of them when cancelled), ends once, the engine sees each request's counters in order and at
most one past the last output, and nothing is left queued, parked, or waiting to resume."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.graph import LoopStep, PortRef
from mstar_async.walks.run import WalkRun
from mstar_async.worker.walk_loop import WalkLoop
from tests.worker.test_run_ahead import Ticker, counting_model

pytestmark = pytest.mark.slow  # a long property test: 100 walks of random shapes


def _stop(step: LoopStep) -> bool:
    return int(step.outputs["tick.n"]) >= int(step.params["stop"])


def _plan(max_iterations: int) -> Any:
    return counting_model(max_iterations, until=_stop).plan("count")


class Reader:
    """One walk's sink: keeps its outputs, acknowledges them a checkpoint later, and cancels
    the walk after ``cancel_at`` outputs when set."""

    def __init__(self, cancel_at: int | None) -> None:
        self.values: list[int] = []
        self.ends = 0
        self.error: BaseException | None = None
        self.cancel_at = cancel_at
        self.run: WalkRun | None = None

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.values.append(int(value))

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.ends += 1
        self.error = error

    async def read(self, loop: WalkLoop) -> None:
        acked = 0
        while True:
            await anyio.lowlevel.checkpoint()
            run = self.run
            assert run is not None
            if self.cancel_at is not None and len(self.values) >= self.cancel_at:
                run.cancel()
                loop.kick()
            if len(self.values) > acked:
                run.ack(len(self.values) - acked)
                acked = len(self.values)
                loop.kick()
            if self.ends:
                return


async def _settled(loop: WalkLoop) -> None:
    """Until no step is queued, in a forward, or launched for a walk still to resume (the
    caller's deadline bounds the wait)."""
    while True:
        if not (loop.scheduler.has_work or loop._in_round or loop.trampoline.later):
            return
        await anyio.sleep(0.001)


walk_specs = st.lists(
    st.tuples(
        st.integers(1, 12),  # the counter the loop stops at
        st.integers(1, 15),  # its iteration limit
        st.integers(1, 3),  # its output window
        st.none() | st.integers(0, 10),  # cancelled after this many outputs
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=100, deadline=None)
@given(walks=walk_specs, threaded=st.booleans())
def test_walks_with_steps_run_ahead_make_exactly_their_outputs(
    walks: list[tuple[int, int, int, int | None]], threaded: bool
) -> None:
    anyio.run(_check, walks, threaded)


async def _check(walks: list[tuple[int, int, int, int | None]], threaded: bool) -> None:
    engine = Ticker(stateless=True, forward_s=0.0005 if threaded else 0.0)
    loop = WalkLoop({"e": engine}, inline_below_s=0.0 if threaded else 1.0)
    readers = [Reader(cancel) for _, _, _, cancel in walks]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(loop.run)
            async with anyio.create_task_group() as reading:
                for i, ((stop, limit, window, _), reader) in enumerate(
                    zip(walks, readers, strict=True)
                ):
                    reader.run = loop.start_walk(
                        _plan(limit),
                        f"r{i}",
                        {PortRef("tick", "n"): 0},
                        {"stop": stop},
                        {},
                        reader,
                        window=window,
                    )
                    reading.start_soon(reader.read, loop)
            await _settled(loop)
            tg.cancel_scope.cancel()
    for i, ((stop, limit, _, cancel), reader) in enumerate(zip(walks, readers, strict=True)):
        assert reader.ends == 1 and reader.error is None
        full = list(range(1, min(stop, limit) + 1))
        if cancel is None:
            assert reader.values == full
        else:
            assert reader.values == full[: len(reader.values)]
        seen = engine.by_request.get(f"r{i}", [])
        assert seen == list(range(len(seen)))  # in order, each once
        assert len(seen) <= len(reader.values) + 2  # the step in flight and one run ahead
    assert loop.walks_running == 0
    assert not loop.trampoline.ready and not loop.trampoline.later
    assert not loop.scheduler.has_work and not loop._declined
