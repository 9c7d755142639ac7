"""Walks with a loop spanning ranks: run here, on the conductor, each step sent to its rank.

The interpreter is the one workers run (``mstar_async.walks``); only where its steps go
differs. Each step is one message to the rank that placement names, answered by one reply, so
such a walk pays a round trip per step. A walk whose nodes all sit on one rank runs on that
worker instead, and one whose every loop sits on one rank runs as one segment per rank on the
workers (see ``PlacedExecutor.hosts``); this path also takes walks whose request state must move
between ranks first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from mstar_async.conductor.executor import StepExecutor, materialize
from mstar_async.conductor.task_owner import TaskGroupOwner
from mstar_async.graph import PortRef, WalkPlan
from mstar_async.transport import StepCall
from mstar_async.walks import (
    FetchRequest,
    StepRequest,
    Task,
    TaskGroup,
    Trampoline,
    WalkRun,
    WalkSink,
)
from mstar_async.walks.handle import RunningWalk


class StepwiseWalks(TaskGroupOwner):
    """Runs walks on the conductor's event loop, sending every step to ``executor``.

    Use as ``async with StepwiseWalks(executor) as walks:``; leaving cancels steps in flight.
    """

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor
        self.trampoline = Trampoline(self._submit, self._fetch)
        self._scheduled = False
        self._steps: dict[TaskGroup, set[anyio.CancelScope]] = {}

    def hosts(self, request_id: str, plan: WalkPlan) -> bool:
        """Any walk can run here."""
        return True

    def open_walk(
        self,
        request_id: str,
        plan: WalkPlan,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkSink,
    ) -> RunningWalk:
        """Start the walk here (see ``WalkHost``). Never raises: errors reach ``sink``."""
        run = WalkRun(plan, request_id, inputs, params, persisted, self.trampoline, sink)
        run.start()
        self.kick()
        return RunningWalk(run, self.kick, lambda: self.cancel_steps(run.group))

    def kick(self) -> None:
        """Resume ready walk coroutines soon (once per turn of the event loop)."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run_ready)

    def _run_ready(self) -> None:
        self._scheduled = False
        self.trampoline.run_ready()

    def cancel_steps(self, group: TaskGroup) -> None:
        """Cancel the steps in flight for the walk whose task group is ``group``."""
        for scope in self._steps.pop(group, ()):
            scope.cancel()

    def _submit(self, task: Task, request: StepRequest) -> None:
        call = StepCall(
            request.request_id,
            request.engine,
            request.op,
            request.inputs,
            request.node,
            request.walk,
        )
        self._spawn(task, lambda: self.executor.submit(call))

    def _fetch(self, task: Task, request: FetchRequest) -> None:
        self._spawn(task, lambda: materialize(self.executor, request.ref))

    def _spawn(self, task: Task, work: Callable[[], Awaitable[Any]]) -> None:
        assert self._task_group is not None, "StepwiseWalks is not open"
        scope = anyio.CancelScope()
        self._steps.setdefault(task.group, set()).add(scope)
        self._task_group.start_soon(self._await, task, work, scope)

    async def _await(
        self, task: Task, work: Callable[[], Awaitable[Any]], scope: anyio.CancelScope
    ) -> None:
        outcome: Any = None
        with scope:
            try:
                outcome = await work()
            except Exception as exc:  # handed to the walk coroutine that asked
                outcome = exc
        scopes = self._steps.get(task.group)
        if scopes is not None:
            scopes.discard(scope)
            if not scopes:
                del self._steps[task.group]
        if not scope.cancel_called:
            self.trampoline.wake(task, outcome)
            self.kick()
