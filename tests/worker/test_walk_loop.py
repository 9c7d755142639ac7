"""Walks driven by a worker's batching loop: output credit holds a producer at its window, in
this process and across processes; slow forwards leave the loop's thread, fast ones stay."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.engines import Step
from mstar_async.graph import Model
from mstar_async.models import build_model
from mstar_async.models.noop import NoopEngine
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.walks.run import OUTPUT_WINDOW
from mstar_async.worker.scheduler import Job
from mstar_async.worker.walk_loop import WalkLoop
from tests.worker.models import build_listener

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ITERATIONS = 500


async def settled(
    read: Callable[[], Awaitable[int]], *, at_least: int = 0, quiet: float = 0.3
) -> int:
    """``read()`` once it is at least ``at_least`` and has then stopped changing for ``quiet``
    seconds (deadline-bounded by the test's timeout): the producer has reached whatever holds
    it, however slowly a loaded machine got it there."""
    last = await read()
    stable_since = anyio.current_time()
    while last < at_least or anyio.current_time() - stable_since < quiet:
        await anyio.sleep(0.02)
        now = await read()
        if now != last:
            last, stable_since = now, anyio.current_time()
    return last


async def test_a_reader_that_stops_holds_the_walk_at_its_window_in_process() -> None:
    async with open_runtime(build_model("noop")) as runtime:
        stats = runtime.batching.stats

        async def steps() -> int:
            return stats.steps

        async with runtime.generate(iterations=ITERATIONS) as outputs:
            first = await outputs.__anext__()
            assert first[0] == 1
            held = await settled(steps, at_least=OUTPUT_WINDOW)
            # One read, a full window in flight, one program output queued in the request's
            # buffer per read, the step that found the window full and the one launched after
            # it (the noop engine is stateless: its loop's next step runs ahead of the walk).
            assert OUTPUT_WINDOW <= held <= 1 + OUTPUT_WINDOW + 16 + 3
            rest = [item async for item in outputs]
        assert [tick[0] for tick in rest] == list(range(2, ITERATIONS + 1))


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_a_reader_that_stops_holds_the_walk_at_its_window_across_processes() -> None:
    async with open_runtime(build_model("noop"), placement=Placement.single()) as runtime:
        assert runtime.pool is not None
        pool = runtime.pool

        async def steps() -> int:
            return (await pool.worker_stats(0))["steps"]

        async with runtime.generate(iterations=ITERATIONS) as outputs:
            first = await outputs.__anext__()
            assert first[0] == 1
            held = await settled(steps, at_least=OUTPUT_WINDOW)
            assert OUTPUT_WINDOW <= held <= 1 + OUTPUT_WINDOW + 16 + 3
            assert (await pool.worker_stats(0))["walks"] == 1
            rest = [item async for item in outputs]
        assert [tick[0] for tick in rest] == list(range(2, ITERATIONS + 1))
        assert await settled(lambda: _walks(pool)) == 0


async def _walks(pool: Any) -> int:
    return int((await pool.worker_stats(0))["walks"])


async def test_slow_forwards_run_off_the_loop_thread_and_fast_ones_inline() -> None:
    loop_thread = threading.get_ident()
    # Thresholds far from the forwards' times, so a loaded machine cannot flip the choice.
    for forward_ms, bound_s, inline_expected in ((0.0, 1.0, True), (20.0, 0.002, False)):
        async with open_runtime(build_model("noop", forward_ms=forward_ms)) as runtime:
            runtime.batching.inline_below_s = bound_s
            engine = runtime.batching.engines["noop"]
            threads: list[int] = []
            forward = engine.forward

            def watched(steps: Any, forward: Any = forward, threads: list[int] = threads) -> Any:
                threads.append(threading.get_ident())
                return forward(steps)

            engine.forward = watched  # type: ignore[method-assign]
            async with runtime.generate(iterations=20) as outputs:
                assert len([item async for item in outputs]) == 20
            assert threads[0] != loop_thread  # nothing measured yet: off the loop
            later = threads[5:]
            assert all((t == loop_thread) == inline_expected for t in later)


async def test_a_fast_forward_sent_to_the_thread_once_comes_back_inline() -> None:
    # The hand-off to the forward thread and back is made slow (50 ms) while the forward stays
    # fast: timing the forward with its hand-off would keep every later forward on the thread.
    async with open_runtime(build_model("noop")) as runtime:
        batching = runtime.batching
        batching.inline_below_s = 0.01
        thread = batching._thread
        assert thread is not None
        start = thread.start

        def slow_handoff(fn: Any) -> asyncio.Future[None]:
            loop = asyncio.get_running_loop()
            handed_back: asyncio.Future[None] = loop.create_future()
            start(fn).add_done_callback(
                lambda _: loop.call_later(0.05, handed_back.set_result, None)
            )
            return handed_back

        thread.start = slow_handoff  # type: ignore[method-assign]
        loop_thread = threading.get_ident()
        threads: list[int] = []
        engine = batching.engines["noop"]
        forward = engine.forward

        def watched(steps: Any) -> Any:
            threads.append(threading.get_ident())
            return forward(steps)

        engine.forward = watched  # type: ignore[method-assign]
        async with runtime.generate(iterations=10) as outputs:
            assert len([item async for item in outputs]) == 10
        assert threads[0] != loop_thread
        assert all(t == loop_thread for t in threads[1:])


async def test_leaving_a_request_frees_its_kv_and_leaves_no_walk(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    async with open_runtime(model) as runtime:
        engine = runtime.batching.engines["lm"]
        async with runtime.generate(
            prompt="hello " * 40, max_tokens=200, ignore_eos=True
        ) as outputs:
            await outputs.__anext__()
            assert engine.blocks_in_use > 0
        assert engine.blocks_in_use == 0
        assert runtime.batching.walks_running == 0
        assert not runtime.batching.scheduler.has_work


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_a_streamed_walk_input_reaches_a_worker_process_with_backpressure() -> None:
    read: list[int] = []

    async def frames(count: int) -> AsyncGenerator[list[int], None]:
        for i in range(count):
            read.append(i)
            yield [i]

    async with open_runtime(build_listener(), placement=Placement.single()) as runtime:
        async with runtime.generate(frames=frames(10)) as outputs:
            assert [s async for s in outputs] == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9]
        async with runtime.generate(frames=frames(100_000)) as outputs:
            await outputs.__anext__()
            before = len(read)
            await anyio.sleep(0.5)  # the source would be read to the end without backpressure
            assert len(read) - before < 4 * (OUTPUT_WINDOW + 16 + 4)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_leaving_a_request_frees_its_kv_on_the_worker(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=str(tiny_folder), dtype="float32")
    async with open_runtime(model, placement=Placement.single()) as runtime:
        assert runtime.pool is not None
        pool = runtime.pool
        async with runtime.generate(
            prompt="hello " * 40, max_tokens=400, ignore_eos=True
        ) as outputs:
            await outputs.__anext__()
            assert (await pool.worker_stats(0))["kv_blocks"] > 0
        # aclose() has returned: the cancel and the release are on their way to the worker.
        with anyio.fail_after(10):
            assert await settled(lambda: _held(pool), quiet=0.1) == 0


async def _held(pool: Any) -> int:
    stats = await pool.worker_stats(0)
    return int(stats["kv_blocks"] + stats["walks"])


async def test_engines_are_built_on_the_thread_that_runs_their_forwards() -> None:
    # One OpenMP team per process: an engine built on another thread would leave a second one,
    # and libgomp then stops spinning between parallel ops (docs: ForwardThread).
    model = build_model("noop", forward_ms=2.0)  # slow enough to leave the loop's thread
    built: list[str] = []
    ran: list[str] = []
    make = model.components["noop"]

    def factory() -> Any:
        built.append(threading.current_thread().name)
        engine = make()
        forward = engine.forward

        def recording(steps: Any) -> Any:
            ran.append(threading.current_thread().name)
            return forward(steps)

        engine.forward = recording
        return engine

    # The noop model, its engine built (and its forwards run) through the factory above.
    model = Model(
        "noop",
        nodes=list(model.nodes.values()),
        walks=list(model.walks.values()),
        program=model.program,
        components={"noop": factory},
    )
    async with open_runtime(model) as runtime:
        async with runtime.generate(iterations=5) as outputs:
            assert len([item async for item in outputs]) == 5
    assert built == ["mstar-forward"] and set(ran) == {"mstar-forward"}


@pytest.mark.parametrize("placement", [None, Placement.single()], ids=["in-process", "worker"])
async def test_a_request_ends_while_another_keeps_the_engine_busy(
    placement: Placement | None,
) -> None:
    # Forwards of 2 ms run on the forward thread: the loop yields only while one runs, and a
    # release that waits for the loop to be between rounds must still get its turn (it once
    # waited until the busy request ended).
    model = build_model("noop", forward_ms=2.0)
    async with open_runtime(model, placement=placement) as runtime:
        busy_running = anyio.Event()
        short_done = anyio.Event()
        busy_outputs = 0

        async def busy() -> None:
            nonlocal busy_outputs
            async with runtime.generate(iterations=1_000_000) as outputs:
                async for _ in outputs:
                    busy_outputs += 1
                    busy_running.set()
                    if short_done.is_set():
                        break

        async with anyio.create_task_group() as tg:
            tg.start_soon(busy)
            await busy_running.wait()
            with anyio.fail_after(30):
                for _ in range(3):
                    async with runtime.generate(iterations=3) as outputs:
                        assert [n async for n, _, _ in outputs] == [1, 2, 3]
            at_end = busy_outputs
            short_done.set()
        assert at_end < 1_000_000  # the busy request was still running throughout


class _FailingRelease:
    """The noop engine with 2 ms forwards (run on the forward thread) whose ``release`` of
    request ``bad`` raises."""

    def __init__(self) -> None:
        self.inner = NoopEngine(forward_ms=2.0)

    def release(self, request_id: str) -> None:
        if request_id == "bad":
            raise RuntimeError("release failed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_release_that_fails_during_a_round_raises_to_its_caller_and_the_loop_goes_on() -> (
    None
):
    loop = WalkLoop({"e": _FailingRelease()}, inline_below_s=0.0)
    async with anyio.create_task_group() as tg:
        await tg.start(loop.run)
        with anyio.fail_after(10):
            future = asyncio.get_running_loop().create_future()
            loop.scheduler.submit(Job("e", Step("bad", "count", {"x": (0, 0, 0)}), future))
            loop.kick()
            while not loop._in_round:  # noqa: ASYNC110  (released mid-round: after the round)
                await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="release failed"):
                await loop.release("bad")
            assert (await future)["x"][0] == 1
            ok = asyncio.get_running_loop().create_future()
            loop.scheduler.submit(Job("e", Step("good", "count", {"x": (4, 0, 0)}), ok))
            loop.kick()
            assert (await ok)["x"][0] == 5  # the loop still runs rounds
        tg.cancel_scope.cancel()
