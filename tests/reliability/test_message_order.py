"""Messages between the conductor and the workers, and between workers, arriving in any order:
walks split over two worker processes, with the conductor's messages to each rank held back by
random delays (as a slow or busy link would), so that a rank hears from its peer before it hears
of the walk, or of a cancel before its peer is done. Every request still ends (answered or
cancelled), the answers are right, and no rank keeps a tensor, a request or a walk."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
import torch

from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.transport import StartWalk, WalkCredit
from mstar_async.worker.pool import WorkerPool
from tests.worker.models import build_handoff

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]

SPLIT = Placement(nodes={"use": 1, "use2": 1})  # make and check on rank 0, use on rank 1
REQUESTS = 24


async def test_walks_split_over_two_ranks_end_whatever_order_their_messages_arrive_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chance = random.Random(20261202)
    send = WorkerPool._send_walk_message

    async def late(self: WorkerPool, rank: int, message: Any) -> None:
        if isinstance(message, StartWalk | WalkCredit) and chance.random() < 0.5:
            await anyio.sleep(chance.uniform(0.0, 0.05))
        await send(self, rank, message)

    async with open_runtime(build_handoff()) as local:
        expected = {x: await _answer(local, x) for x in range(REQUESTS)}
    monkeypatch.setattr(WorkerPool, "_send_walk_message", late)
    async with open_runtime(build_handoff(), placement=SPLIT) as runtime:
        pool = runtime.pool
        assert pool is not None
        answers: dict[int, list[torch.Tensor]] = {}
        cancelled: list[int] = []

        async def one(x: int) -> None:
            if x % 4 == 3:  # every fourth client leaves after a random while
                with anyio.move_on_after(chance.uniform(0.0, 0.2)) as scope:
                    answers[x] = await _answer(runtime, x)
                if scope.cancelled_caught:
                    cancelled.append(x)
                return
            answers[x] = await _answer(runtime, x)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for x in range(REQUESTS):
                    tg.start_soon(one, x)
        for x, got in answers.items():
            for a, b in zip(got, expected[x], strict=True):
                assert torch.equal(a, b)
        assert len(answers) + len(cancelled) == REQUESTS
        with anyio.fail_after(30):
            while True:
                stats = [await pool.worker_stats(rank) for rank in sorted(pool.ranks)]
                if all(s["walks"] == 0 for s in stats):
                    break
                await anyio.sleep(0.05)
        assert [s["tensors_held"] for s in stats] == [0, 0]
        assert [s["requests_held"] for s in stats] == [0, 0]


async def _answer(runtime: Any, x: int) -> list[torch.Tensor]:
    async with runtime.generate(x=float(x)) as outputs:
        return [item async for item in outputs]
