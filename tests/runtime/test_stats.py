"""``Runtime.stats()``: one shape in process and on worker ranks; settings reach every rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from mstar_async.models import build_model
from mstar_async.outputs import TextDelta
from mstar_async.placement import Placement
from mstar_async.runtime import ConductorStats, Runtime, RuntimeSettings, RuntimeStats, open_runtime
from tests.runtime.helpers import SPEECH, tiny_lm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CODEC_SPLIT = Placement(nodes={"codec": 1})
#: Worker processes run uvloop whatever the test's loop: the conductor's side runs on one.
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
QUESTIONS = ["one", "two", "three", "four"]


async def _ask(runtime: Runtime, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    async with runtime.generate(messages=messages, max_tokens=6, ignore_eos=True) as outputs:
        return "".join([o.text async for o in outputs if isinstance(o, TextDelta)])


async def _ask_all(runtime: Runtime) -> None:
    async with anyio.create_task_group() as tg:
        for prompt in QUESTIONS:
            tg.start_soon(_ask, runtime, prompt)


def _check_counts(stats: RuntimeStats, rank: int) -> None:
    seen = stats.ranks[rank]
    assert seen.up and seen.reason == "" and seen.restarts == 0
    assert seen.forwards > 0 and seen.steps >= seen.forwards
    assert sum(seen.batch_sizes.values()) == seen.forwards
    assert sum(size * n for size, n in seen.batch_sizes.items()) == seen.steps
    assert seen.running == 0 and seen.waiting == 0


async def test_in_process_is_rank_0_with_the_loops_counts(tiny_folder: Path) -> None:
    async with open_runtime(tiny_lm(tiny_folder)) as runtime:
        before = await runtime.stats()
        async with runtime.generate(messages=[{"role": "user", "content": "hi"}]) as running:
            assert (await runtime.stats()).conductor.requests == 1
            async for _ in running:
                pass
        await _ask_all(runtime)
        after = await runtime.stats()
    assert list(before.ranks) == [0] and before.ranks[0].forwards == 0
    _check_counts(after, 0)
    used, total = after.ranks[0].kv["lm"]
    assert used == 0 and total > 0 and after.ranks[0].kv_total == total
    assert after.conductor == ConductorStats(requests=0, step_messages=0, bytes_received=0)
    # Four requests at once share forwards: some batch held more than one step.
    assert max(after.ranks[0].batch_sizes) > 1


async def _released(runtime: Runtime) -> RuntimeStats:
    """Stats once every KV block is back: a worker frees a request's blocks when the release
    the conductor sends after the request's end arrives."""
    with anyio.fail_after(5):
        while (stats := await runtime.stats()).ranks[0].kv_used:  # noqa: ASYNC110  (a worker)
            await anyio.sleep(0.01)
    return stats


@ONE_LOOP
async def test_worker_ranks_report_the_same_shape(tiny_folder: Path) -> None:
    async with open_runtime(tiny_lm(tiny_folder), placement=Placement.single()) as runtime:
        await _ask_all(runtime)
        stats = await _released(runtime)
    _check_counts(stats, 0)
    assert stats.ranks[0].kv_total > 0
    assert stats.conductor.step_messages == 0  # the walks ran on the worker, loops and all
    assert stats.conductor.bytes_received > 0  # their outputs came back


@ONE_LOOP
async def test_settings_reach_every_worker_rank(tiny_folder: Path) -> None:
    one_at_a_time = RuntimeSettings(max_batch_size=1)
    model = tiny_lm(tiny_folder)
    async with open_runtime(model, placement=Placement.single(), settings=one_at_a_time) as rt:
        await _ask_all(rt)
        stats = await rt.stats()
    assert set(stats.ranks[0].batch_sizes) == {1}


@ONE_LOOP
async def test_a_killed_rank_is_down_with_why_then_back_with_a_restart() -> None:
    async with open_runtime(build_model("demo"), placement=CODEC_SPLIT) as runtime:
        assert runtime.pool is not None
        victim = runtime.pool.pid(1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        with anyio.fail_after(60):
            while (await runtime.stats()).ranks[1].up:  # noqa: ASYNC110  (another process)
                await anyio.sleep(0.01)
        down = (await runtime.stats()).ranks[1]
        assert down.reason.startswith("worker rank 1 ") and down.forwards == 0
        with anyio.fail_after(60):
            while not (await runtime.stats()).ranks[1].up:  # noqa: ASYNC110  (as above)
                await anyio.sleep(0.05)
        async with runtime.generate(**SPEECH) as outputs:
            assert [item async for item in outputs]
        back = await runtime.stats()
    assert back.ranks[1].restarts == 1 and back.ranks[1].forwards > 0
    assert back.ranks[0].restarts == 0 and back.ranks[0].up
