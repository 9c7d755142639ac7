"""The trampoline that resumes walk coroutines: waking, steps, errors and cancellation."""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.walks.trampoline import (
    Condition,
    Flag,
    StepRequest,
    Task,
    TaskGroup,
    Trampoline,
)


class Recorder:
    def __init__(self) -> None:
        self.steps: list[tuple[Task, StepRequest]] = []
        self.ends: list[BaseException | None] = []

    def submit(self, task: Task, request: StepRequest) -> None:
        self.steps.append((task, request))


def make() -> tuple[Trampoline, Recorder, TaskGroup]:
    recorder = Recorder()
    trampoline = Trampoline(recorder.submit)
    return trampoline, recorder, TaskGroup(trampoline, recorder.ends.append)


def test_a_step_suspends_until_woken_with_its_outputs() -> None:
    trampoline, recorder, group = make()
    seen: list[Any] = []

    async def node() -> None:
        outputs = await StepRequest("r", "lm", "decode", {"x": 1}, "n")
        seen.append(outputs)

    group.spawn(node())
    trampoline.run_ready()
    assert [r.inputs for _, r in recorder.steps] == [{"x": 1}] and seen == []
    task, _ = recorder.steps[0]
    trampoline.wake(task, {"y": 2})
    trampoline.run_ready()
    assert seen == [{"y": 2}]
    assert recorder.ends == [None] and group.ended and not group.live
    assert trampoline.groups == 0


def test_a_thrown_step_error_fails_the_group_and_closes_its_siblings() -> None:
    trampoline, recorder, group = make()
    closed: list[str] = []

    async def waiting(name: str) -> None:
        try:
            await StepRequest("r", "lm", "decode", {}, name)
        finally:
            closed.append(name)

    group.spawn(waiting("a"))
    group.spawn(waiting("b"))
    trampoline.run_ready()
    boom = ValueError("boom")
    trampoline.wake(recorder.steps[0][0], boom)
    trampoline.run_ready()
    assert recorder.ends == [boom]
    assert sorted(closed) == ["a", "b"] and not group.live
    trampoline.wake(recorder.steps[1][0], {"late": 1})  # a dead task is never resumed
    trampoline.run_ready()
    assert recorder.ends == [boom]


def test_conditions_and_flags_wake_every_waiter_once() -> None:
    trampoline, _, group = make()
    flag = Flag(trampoline)
    cond = Condition(trampoline)
    order: list[str] = []

    async def on_flag(name: str) -> None:
        await flag.wait()
        order.append(name)

    async def on_cond() -> None:
        await cond
        order.append("cond")
        await flag.wait()  # already set: no suspension
        order.append("after")

    for name in ("x", "y"):
        group.spawn(on_flag(name))
    group.spawn(on_cond())
    trampoline.run_ready()
    assert order == [] and len(cond.waiters) == 1
    cond.notify_all()
    trampoline.run_ready()
    assert order == ["cond"]
    flag.set()
    flag.set()
    trampoline.run_ready()
    assert order == ["cond", "x", "y", "after"]  # woken in the order they began to wait
    assert group.ended


def test_cancel_closes_tasks_runs_their_finally_and_ends_once() -> None:
    trampoline, recorder, group = make()
    finished: list[bool] = []

    async def node() -> None:
        try:
            await StepRequest("r", "lm", "decode", {}, "n")
        finally:
            finished.append(True)

    group.spawn(node())
    trampoline.run_ready()
    assert trampoline.groups == 1
    group.cancel()
    group.cancel()
    assert finished == [True] and recorder.ends == [None] and trampoline.groups == 0
    trampoline.wake(recorder.steps[0][0], {"y": 1})
    trampoline.run_ready()  # nothing to resume
    assert recorder.ends == [None]


def test_awaiting_a_foreign_awaitable_fails_the_walk_clearly() -> None:
    trampoline, recorder, group = make()

    class Foreign:
        def __await__(self) -> Any:
            yield "not ours"

    async def node() -> None:
        await Foreign()

    group.spawn(node())
    trampoline.run_ready()
    (error,) = recorder.ends
    assert isinstance(error, TypeError) and "cannot run" in str(error)


@pytest.mark.parametrize("count", [1, 3, 50])
def test_many_tasks_each_resume_in_submission_order(count: int) -> None:
    trampoline, recorder, group = make()
    results: list[int] = []

    async def node(i: int) -> None:
        outputs = await StepRequest("r", "lm", "decode", {"i": i}, "n")
        results.append(outputs["i"])

    for i in range(count):
        group.spawn(node(i))
    trampoline.run_ready()
    for task, request in recorder.steps:
        trampoline.wake(task, {"i": request.inputs["i"] * 10})
    trampoline.run_ready()
    assert results == [i * 10 for i in range(count)]
    assert recorder.ends == [None]
