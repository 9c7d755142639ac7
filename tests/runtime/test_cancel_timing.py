"""Cancelling a request frees its KV blocks within 100 ms, whichever way it is cancelled, and a
cancellation of the consuming task always reaches that task as CancelledError."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import anyio
import pytest

from mstar_async.outputs import TextDelta
from mstar_async.runtime import Runtime, open_runtime
from tests.runtime.helpers import one_torch_thread, settled_tasks, tiny_lm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LONG = {"prompt": "The capital of France is", "max_tokens": 4000, "ignore_eos": True}
BUDGET = 0.1  # seconds from cancel to every KV block back in the pool


def _blocks(runtime: Runtime) -> int:
    return int(runtime.batching.engines["lm"].blocks_in_use)


async def _wait_blocks_free(runtime: Runtime, since: float) -> float:
    # Polls without sleeping so the measured time is not rounded up to a sleep's length.
    while _blocks(runtime) > 0:
        await anyio.lowlevel.checkpoint()
        if time.perf_counter() - since > 5:
            raise AssertionError(f"{_blocks(runtime)} KV blocks still held 5 s after cancel")
    return time.perf_counter() - since


async def test_aclose_frees_kv_within_budget(tiny_folder: Path) -> None:
    times = []
    with one_torch_thread(), anyio.fail_after(50):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            for _ in range(3):
                outputs = runtime.generate(**LONG)
                deltas = [await outputs.__anext__() for _ in range(4)]
                assert all(isinstance(d, TextDelta) for d in deltas)
                assert _blocks(runtime) > 0
                cancelled_at = time.perf_counter()
                await outputs.aclose()
                assert _blocks(runtime) == 0  # aclose returns only once the engine released
                times.append(time.perf_counter() - cancelled_at)
                assert outputs.metrics.cancelled and not outputs.metrics.finished
    assert max(times) < BUDGET, times


async def test_cancelling_the_consumers_scope_frees_kv_within_budget(tiny_folder: Path) -> None:
    with one_torch_thread(), anyio.fail_after(50):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            baseline = await settled_tasks()
            cancelled_at = 0.0
            with anyio.CancelScope() as scope:
                async with runtime.generate(**LONG) as outputs:
                    received = 0
                    async for _ in outputs:
                        received += 1
                        if received == 4:
                            cancelled_at = time.perf_counter()
                            scope.cancel()
            assert scope.cancelled_caught
            elapsed = await _wait_blocks_free(runtime, cancelled_at)
            assert elapsed < BUDGET
            assert outputs.metrics.cancelled
            assert (await runtime.stats()).conductor.requests == 0
            assert await settled_tasks() == baseline


async def test_task_cancel_from_the_host_raises_cancelled_error_and_frees_kv(
    tiny_folder: Path,
) -> None:
    with one_torch_thread(), anyio.fail_after(50):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            reading = anyio.Event()
            seen: list[str] = []
            streams = []

            async def consume() -> None:
                async with runtime.generate(**LONG) as outputs:
                    streams.append(outputs)
                    async for delta in outputs:
                        seen.append(getattr(delta, "text", ""))
                        if len(seen) == 4:
                            reading.set()

            task = asyncio.ensure_future(consume())
            await reading.wait()
            cancelled_at = time.perf_counter()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert task.cancelled()  # the CancelledError left the task: nothing swallowed it
            elapsed = await _wait_blocks_free(runtime, cancelled_at)
            assert elapsed < BUDGET
            assert streams[0].metrics.cancelled
            assert (await runtime.stats()).conductor.requests == 0


async def test_aclose_frees_kv_within_budget_while_another_request_keeps_decoding(
    tiny_folder: Path,
) -> None:
    # The batching loop goes from round to round without a pause while a request that is read
    # as it goes decodes on the forward thread (as any model worth a thread does); a release
    # waiting for a pause between rounds once waited for that request to end.
    times = []
    busy_tokens = 0
    with one_torch_thread(), anyio.fail_after(50):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            runtime.batching.inline_below_s = 0.0  # the tiny model's forwards are that cheap
            allocator = runtime.batching.engines["lm"].allocator
            closed = anyio.Event()

            async def busy() -> None:
                nonlocal busy_tokens
                async with runtime.generate(**LONG) as outputs:
                    async for _ in outputs:
                        busy_tokens += 1
                        if closed.is_set():
                            return

            async with anyio.create_task_group() as tg:
                tg.start_soon(busy)
                for _ in range(3):
                    outputs = runtime.generate(**LONG)
                    deltas = [await outputs.__anext__() for _ in range(4)]
                    assert all(isinstance(d, TextDelta) for d in deltas)
                    assert allocator.has(outputs.request_id)
                    cancelled_at = time.perf_counter()
                    with anyio.move_on_after(5):  # the release is shielded: bound the wait
                        await outputs.aclose()
                    times.append(time.perf_counter() - cancelled_at)
                    # Released while the other kept decoding (which may take a block meanwhile).
                    assert not allocator.has(outputs.request_id)
                at_end = busy_tokens
                closed.set()
    assert 0 < at_end < LONG["max_tokens"]  # the other request was decoding throughout
    assert max(times) < BUDGET, times
