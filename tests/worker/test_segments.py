"""Walks whose nodes span ranks run as one segment per rank on the workers: the conductor sends
no step, relays edges with backpressure, and a cancel, an error or a lost worker on one rank ends
every segment."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from mstar_async.errors import PlacementError, RequestError, WorkerLost
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.walks.run import OUTPUT_WINDOW
from mstar_async.worker.pool import WorkerPool
from mstar_async.worker.segmented import SegmentedWalk

from .models import BOUND, CHUNK, build_two_ranks

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]

# Walk bounce's loop (bump on the counter engine, echo) lives on rank 1 whole.
TWO_RANKS = Placement(nodes={"sink": 1, "echo": 1}, walks={"bounce": {"bump": 1}})
ENDLESS = 10**6  # iterations no test waits for: only a cancel, an error or a loss ends them


async def collect(runtime: Runtime, **inputs: Any) -> list[Any]:
    with anyio.fail_after(60):
        async with runtime.generate(**inputs) as outputs:
            return [item async for item in outputs]


async def steps_on(pool: WorkerPool, rank: int) -> int:
    return int((await pool.worker_stats(rank))["steps"])


async def settled(read: Callable[[], Awaitable[int]], quiet: float = 0.3) -> int:
    """``read()`` once it has stopped changing for ``quiet`` seconds."""
    with anyio.fail_after(30):
        last, since = await read(), anyio.current_time()
        while anyio.current_time() - since < quiet:
            await anyio.sleep(0.02)
            now = await read()
            if now != last:
                last, since = now, anyio.current_time()
    return last


async def assert_nothing_left(runtime: Runtime) -> None:
    """No walk, kept tensor or request state on any rank, and no walk traffic waiting in the
    pool."""
    pool = runtime.pool
    assert pool is not None

    async def busy() -> int:
        stats = [await pool.worker_stats(rank) for rank in sorted(pool.ranks)]
        return sum(s["walks"] + s["requests_held"] for s in stats)

    assert await settled(busy) == 0
    assert not runtime.conductor.active
    assert not pool._walks and not pool._feeds


async def test_a_split_walk_gives_the_in_process_answers_without_a_step_message() -> None:
    async with open_runtime(build_two_ranks()) as local:
        expected = await collect(local, n=41)
        expected_bounce = await collect(local, n=7, walk="bounce")
    # head.y (0) counts up to 41 in chunks of two, each chunk's sum times gain on rank 1; tail,
    # on rank 0, runs after sink and adds 1000 to sink's last output.
    assert expected[0] == ("sink.out", 3.0) and expected[-1] == ("tail.z", 1041.0)
    async with open_runtime(build_two_ranks(), placement=TWO_RANKS) as runtime:
        pool = runtime.pool
        assert pool is not None
        counted = await steps_on(pool, 0)
        assert await collect(runtime, n=41) == expected
        # Forty-one loop iterations ran on rank 0, and not one step message left the conductor;
        # the edge's 41 items and its end went from rank 0 to rank 1 directly, and rank 0's
        # wait for rank 1's unit came from rank 1 directly.
        assert await steps_on(pool, 0) - counted >= 41
        assert pool.stats().step_messages == 0
        rank0, rank1 = await pool.worker_stats(0), await pool.worker_stats(1)
        assert rank0["peer_entries_sent"] >= 42 and rank1["peer_entries_taken"] >= 42
        assert rank1["peer_entries_sent"] >= 1 and rank0["peer_entries_taken"] >= 1
        # The loop of walk bounce runs whole on rank 1: fourteen steps there, no message each.
        counted = await steps_on(pool, 1)
        assert await collect(runtime, n=7, walk="bounce") == expected_bounce
        assert await steps_on(pool, 1) - counted >= 14
        assert pool.stats().step_messages == 0 and pool.stats().state_bytes == 0
        await assert_nothing_left(runtime)


async def test_a_loop_placed_across_ranks_is_refused_before_any_worker_starts() -> None:
    across = Placement(nodes={"sink": 1, "echo": 1})  # bounce: bump on rank 0, echo on rank 1
    with pytest.raises(PlacementError) as caught:
        async with open_runtime(build_two_ranks(), placement=across):
            raise AssertionError("the runtime opened")
    assert str(caught.value) == (
        "walk 'bounce': its DynamicLoop over nodes ['bump', 'echo'] spans ranks ('bump' on "
        "rank 0, 'echo' on rank 1); a loop lives on one rank, so that its steps never cross a "
        "process: place every node of the loop on the same rank (or the same replicas), e.g. "
        "with a walks: override for this walk"
    )


async def test_a_slow_consumer_holds_the_producer_on_the_other_rank() -> None:
    async with open_runtime(build_two_ranks(), placement=TWO_RANKS) as runtime:
        pool = runtime.pool
        assert pool is not None
        ahead = 0
        async with runtime.generate(n=400, delay=0.02) as outputs:
            async for port, _ in outputs:
                if port != "sink.out":
                    continue
                produced = await steps_on(pool, 0) - 1  # head's step; read first, so that
                consumed = await steps_on(pool, 1) * CHUNK  # what is ahead is never overstated
                ahead = max(ahead, produced - consumed)
        # Unconsumed items: the producer's output window (items queued on rank 1 or on their
        # way), what rank 1 took in (its buffer's bound, the chunk in the forward, a partial
        # chunk), the step that found the window full and the one launched after it (the
        # counter's engine is stateless, so its loop's next step runs ahead of the walk).
        most = OUTPUT_WINDOW + (BOUND + 1) * CHUNK + 1 + 1 + 1
        assert BOUND * CHUNK <= ahead <= most, ahead
        await assert_nothing_left(runtime)


async def test_cancelling_a_split_walk_stops_every_rank() -> None:
    async with open_runtime(build_two_ranks(), placement=TWO_RANKS) as runtime:
        pool = runtime.pool
        assert pool is not None
        async with runtime.generate(n=ENDLESS) as outputs:
            for _ in range(3):
                await outputs.__anext__()
            assert isinstance(outputs.context.walk_streams[0]._control, SegmentedWalk)  # type: ignore[union-attr]
        await assert_nothing_left(runtime)
        stopped = await settled(lambda: steps_on(pool, 0))
        await anyio.sleep(0.2)
        assert await steps_on(pool, 0) == stopped
        assert len(await collect(runtime, n=5)) == 4  # and the runtime still serves


async def test_an_error_on_one_rank_ends_the_walk_and_stops_the_other() -> None:
    async with open_runtime(build_two_ranks(), placement=TWO_RANKS) as runtime:
        pool = runtime.pool
        assert pool is not None
        with pytest.raises(RequestError) as caught:
            await collect(runtime, n=ENDLESS, g=-1.0)
        assert "negative gain" in str(caught.value.__cause__)
        await assert_nothing_left(runtime)
        # Rank 0's loop stopped long before its end.
        assert await settled(lambda: steps_on(pool, 0)) < 1000


async def test_a_lost_rank_ends_the_walk_with_worker_lost() -> None:
    async with open_runtime(build_two_ranks(), placement=TWO_RANKS) as runtime:
        pool = runtime.pool
        assert pool is not None
        victim = pool.pid(1)
        assert victim is not None
        with pytest.raises(RequestError) as caught:
            async with runtime.generate(n=ENDLESS, delay=0.01) as outputs:
                await outputs.__anext__()
                os.kill(victim, signal.SIGKILL)
                async for _ in outputs:
                    pass
        assert isinstance(caught.value.__cause__, WorkerLost)
        assert "worker rank 1" in str(caught.value.__cause__)
        with anyio.fail_after(60):
            while pool.pid(1) in (None, victim):  # noqa: ASYNC110  (another process's state)
                await anyio.sleep(0.05)
        assert len(await collect(runtime, n=5)) == 4
        await assert_nothing_left(runtime)


def _same(got: list[Any], want: list[Any]) -> None:
    # Outputs of one kind come in order; text made on one rank and audio on another interleave
    # as the ranks' timing has it.
    kinds = {type(x) for x in want}
    assert {type(x) for x in got} == kinds
    pairs = [
        pair
        for kind in kinds
        for pair in zip(
            [x for x in got if type(x) is kind], [x for x in want if type(x) is kind], strict=True
        )
    ]
    for a, b in pairs:
        if isinstance(a, AudioChunk):
            # Ranks get their own share of the cores: thread-count-dependent reductions may
            # differ in the last bits, never more.
            torch.testing.assert_close(a.pcm, b.pcm, atol=1e-5, rtol=0)
        else:
            assert a == b


QWEN = {
    "text": "Say something about the sea.",
    "max_tokens": 12,
    "max_frames": 24,  # 11 frames with the text, 13 after it
    "temperature": 0.0,
    "voice_temperature": 0.0,
    "ignore_eos": True,
}
TALKER_ON_1 = Placement(
    nodes={name: 1 for name in ("talker_prefill", "predictor_prefill", "predictor", "talker")}
    | {"code2wav": 1}
)


@pytest.mark.parametrize(
    ("name", "options", "placement", "inputs", "audio_chunks"),
    [
        (
            "orpheus",
            {},
            Placement(nodes={"snac": 1}),
            {"text": "Hello there, how are you?", "max_tokens": 60, "seed": 1},
            7,  # seeded sampling ends after 7 frames
        ),
        (
            "qwen3-omni",
            {"size": "tiny", "chunk": 4, "left_context": 4},
            Placement(nodes={"code2wav": 1}),
            QWEN,
            6,  # 24 frames in windows of 4, one grid across the end of the text
        ),
        (
            "qwen3-omni",
            {"size": "tiny", "chunk": 4, "left_context": 4},
            TALKER_ON_1,  # the text crosses ranks into the talker's loop, which outlives it
            QWEN,
            6,
        ),
    ],
    ids=["orpheus-snac-split", "qwen3-omni-code2wav-split", "qwen3-omni-talker-split"],
)
async def test_zoo_speech_models_split_give_the_in_process_answers_as_segments(
    name: str,
    options: dict[str, Any],
    placement: Placement,
    inputs: dict[str, Any],
    audio_chunks: int,
) -> None:
    async with open_runtime(build_model(name, **options)) as local:
        expected = await collect(local, **inputs)
    assert len([x for x in expected if isinstance(x, AudioChunk)]) == audio_chunks
    async with open_runtime(build_model(name, **options), placement=placement) as runtime:
        pool = runtime.pool
        assert pool is not None
        _same(await collect(runtime, **inputs), expected)
        # The speech walk ran as segments: each loop on its rank, no step through here.
        assert pool.stats().step_messages == 0
        await assert_nothing_left(runtime)
