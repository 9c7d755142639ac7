"""A request cancelled while its long prompt prefills stops between chunks: no chunk of it runs
after the forward in flight, and its KV is free within 100 ms of that forward's end, in process
and on a worker process."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.engines import Step, StepResult
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, RuntimeSettings, open_runtime
from tests.runtime.helpers import one_torch_thread, tiny_lm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

#: A prompt of ~1,500 tokens, prefilled in many chunks under the small time bound below.
LONG_PROMPT = {"prompt": "seven words of a long prompt here. " * 200, "max_tokens": 4}
BOUND_S = 0.01
BOUNDED = RuntimeSettings(forward_time_bound_s=BOUND_S)
BUDGET = 0.1  # seconds from the end of the forward in flight to every KV block free


class _Timed:
    """Wraps an engine: the (start, end, request ids) of each forward."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.forwards: list[tuple[float, float, set[str]]] = []

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        started = time.perf_counter()
        try:
            return self.inner.forward(steps)
        finally:
            ids = {step.request_id for step in steps}
            self.forwards.append((started, time.perf_counter(), ids))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_cancel_mid_prefill_in_process(tiny_folder: Path) -> None:
    with one_torch_thread(), anyio.fail_after(100):
        async with open_runtime(tiny_lm(tiny_folder), settings=BOUNDED) as runtime:
            timed = _Timed(runtime.batching.engines["lm"])
            runtime.batching.engines["lm"] = timed
            outputs = runtime.generate(**LONG_PROMPT)
            rid = outputs.request_id
            while sum(rid in ids for _, _, ids in timed.forwards) < 3:  # noqa: ASYNC110  (three chunks ran, on the forward thread)
                await anyio.sleep(0.001)
            cancelled_at = time.perf_counter()
            await outputs.aclose()
            freed_at = time.perf_counter()
            assert timed.inner.blocks_in_use == 0
    mine = [(start, end) for start, end, ids in timed.forwards if rid in ids]
    # The cancel reaches the walk on the program's next turn: a round taken before that may
    # still start, no chunk after it.
    assert len([start for start, _ in mine if start > cancelled_at]) <= 1
    in_flight_end = max([end for _, end in mine if end >= cancelled_at], default=cancelled_at)
    assert freed_at - in_flight_end < BUDGET
    assert outputs.metrics.cancelled


async def _worker_counts(runtime: Runtime) -> tuple[int, int]:
    rank = (await runtime.stats()).ranks[0]
    assert rank.up, rank.reason
    return rank.forwards, rank.kv_used


async def test_cancel_mid_prefill_on_a_worker(tiny_folder: Path) -> None:
    model = tiny_lm(tiny_folder)
    async with open_runtime(model, placement=Placement.single(), settings=BOUNDED) as runtime:
        with anyio.fail_after(100):
            before, _ = await _worker_counts(runtime)
            outputs = runtime.generate(**LONG_PROMPT)
            forwards, blocks = before, 0
            while forwards - before < 3 or blocks == 0:  # chunks ran and hold KV
                forwards, blocks = await _worker_counts(runtime)
            cancelled_at = time.perf_counter()
            await outputs.aclose()
            while blocks > 0:  # the worker releases on its own time: poll, no sleep
                forwards_at_free, blocks = await _worker_counts(runtime)
            freed_in = time.perf_counter() - cancelled_at
            later, _ = await _worker_counts(runtime)
    # The forward in flight (at most about the bound, or two decode rounds) plus the budget.
    print(f"freed {freed_in * 1000:.1f} ms after cancel; forwards {forwards_at_free - forwards}")
    assert freed_in < BUDGET + 2 * BOUND_S
    # The count read before the cancel can be a forward old when the cancel leaves (a loaded
    # machine answers slowly), and one forward may be in flight when it arrives: no more.
    assert forwards_at_free - forwards <= 2
    assert later == forwards_at_free
