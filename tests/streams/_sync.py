"""Test helpers that synchronise with other tasks without sleeping."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.lowlevel


async def settle_until(condition: Callable[[], bool], *, spins: int = 1000) -> None:
    """Let other tasks run until ``condition()`` holds, then until all of them are blocked.

    Spinning on checkpoints first (instead of calling ``wait_all_tasks_blocked`` at once) keeps
    fast: on asyncio ``wait_all_tasks_blocked`` polls every 0.1 s while a task is still runnable,
    and a task that just started is runnable for a couple of loop iterations.
    """
    for _ in range(spins):
        if condition():
            await anyio.wait_all_tasks_blocked()
            assert condition(), "condition stopped holding once every task was blocked"
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError(f"condition never held after {spins} checkpoints")
