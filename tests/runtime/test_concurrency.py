"""Many host tasks share one runtime: each request's text equals what it makes alone."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from mstar_async.outputs import TextDelta
from mstar_async.runtime import open_runtime
from tests.requests import collect_text
from tests.runtime.helpers import one_torch_thread, tiny_lm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

PROMPTS = ["The capital of France is", "def main():", "héllo wörld, naïve", "we'll see"]
TASKS = 16


async def test_sixteen_host_tasks_get_what_each_gets_alone(tiny_folder: Path) -> None:
    requests = [
        {"prompt": PROMPTS[i % 4], "max_tokens": 6 + i % 5, "seed": i} for i in range(TASKS)
    ]
    with one_torch_thread():
        await _compare(tiny_folder, requests)


async def _compare(tiny_folder: Path, requests: list[dict[str, object]]) -> None:
    async with open_runtime(tiny_lm(tiny_folder)) as runtime:
        alone = [await collect_text(runtime, **r) for r in requests]
        together: dict[int, str] = {}
        finished: list[bool] = []

        async def one(i: int) -> None:
            async with runtime.generate(**requests[i]) as outputs:
                together[i] = "".join([d.text async for d in outputs if isinstance(d, TextDelta)])
            finished.append(outputs.metrics.finished)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(TASKS):
                    tg.start_soon(one, i)
        stats = await runtime.stats()
    rank = stats.ranks[0]
    assert max(rank.batch_sizes) > 4  # the tasks' steps shared forwards
    assert rank.kv_used == 0 and stats.conductor.requests == 0
    assert [together[i] for i in range(TASKS)] == alone
    assert finished == [True] * TASKS
    assert len(set(alone)) > 4
