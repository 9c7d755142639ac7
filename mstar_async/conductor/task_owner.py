"""``TaskGroupOwner``: an object that is its own ``async with`` scope for the tasks it starts."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import anyio
from anyio.abc import TaskGroup


class TaskGroupOwner:
    """Opens a task group on ``async with`` and cancels what is still running on exit, so the
    tasks an object starts never outlive it (structured concurrency, no orphan tasks)."""

    _task_group: TaskGroup | None = None

    async def __aenter__(self) -> Self:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        finally:
            self._task_group = None
