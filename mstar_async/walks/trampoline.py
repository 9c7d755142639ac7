"""A small cooperative scheduler for walk coroutines: the worker resumes them with ``send``.

Node coroutines of a walk await only the objects of this module (a ``Condition`` to wait on, a
``StepRequest`` to have a step run by the worker's engines). They never touch the event loop:
the ``Trampoline`` resumes each with ``coro.send(value)`` until it suspends again, so one loop
iteration of a request costs a handful of Python calls instead of a task switch, an event and a
channel operation. Everything here runs on one thread (the worker's event-loop thread) and is
synchronous; nothing blocks.

Why not asyncio tasks: a task per node per iteration, plus an event to wake it, costs tens of
microseconds each on these machines, and a request's loop iteration needed several of them.
Here a suspended coroutine is a ``Task`` object sitting in a list, and waking it appends it to
a deque.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any


class Condition:
    """Something walk coroutines wait for: ``await cond`` always suspends until
    ``notify_all``; callers re-check their predicate in a loop (like ``threading.Condition``)."""

    __slots__ = ("trampoline", "waiters")

    def __init__(self, trampoline: Trampoline) -> None:
        self.trampoline = trampoline
        self.waiters: list[Task] = []

    def __await__(self) -> Generator[Condition, Any, None]:
        yield self

    def notify_all(self) -> None:
        """Make every waiting task ready (they run on the trampoline's next pass)."""
        if self.waiters:
            waiters, self.waiters = self.waiters, []
            wake = self.trampoline.wake
            for task in waiters:
                wake(task, None)


class Flag:
    """A condition that, once set, stays set (an event): ``await flag.wait()``."""

    __slots__ = ("_cond", "is_set")

    def __init__(self, trampoline: Trampoline) -> None:
        self.is_set = False
        self._cond = Condition(trampoline)

    def set(self) -> None:
        """Set the flag and wake its waiters; idempotent."""
        if not self.is_set:
            self.is_set = True
            self._cond.notify_all()

    async def wait(self) -> None:
        """Return once the flag is set (at once if it is)."""
        while not self.is_set:
            await self._cond


#: How a loop's next step follows from this one: ``(output port, input port)`` pairs, the
#: outputs of this step that become the inputs of the next (every other input stays as is).
Chain = tuple[tuple[str, str], ...]


class StepRequest:
    """What a node coroutine awaits to run one step: the worker submits it to the engine
    named ``engine`` and resumes the coroutine with the step's outputs (or throws its error).

    ``chain``, where set, says the walk's next step is this one's with the chained outputs as
    inputs, unless the walk stops first (a loop's ``until``): a worker may launch that next
    step before the walk asks for it, and the walk then takes it if it asks for the same.
    """

    __slots__ = ("chain", "engine", "inputs", "node", "op", "request_id", "walk")

    def __init__(
        self,
        request_id: str,
        engine: str,
        op: str,
        inputs: dict[str, Any],
        node: str,
        walk: str = "",
        chain: Chain | None = None,
    ) -> None:
        self.request_id = request_id
        self.engine = engine
        self.op = op
        self.inputs = inputs
        self.node = node
        self.walk = walk
        self.chain = chain

    def __await__(self) -> Generator[StepRequest, Any, dict[str, Any]]:
        outputs: dict[str, Any] = yield self
        return outputs


class Task:
    """One suspended coroutine and the group (a walk) it belongs to. ``ahead`` is whatever
    the driver launched for it before it asked (see ``StepRequest.chain``); the driver's own."""

    __slots__ = ("ahead", "coro", "done", "group")

    def __init__(self, coro: Coroutine[Any, Any, None], group: TaskGroup) -> None:
        self.coro = coro
        self.group = group
        self.done = False
        self.ahead: Any = None


class TaskGroup:
    """The tasks of one walk: the first error fails them all; ``on_end`` runs once when the
    last task ends or the group is cancelled, with the error (``None`` when all went well)."""

    __slots__ = ("ended", "error", "live", "on_end", "trampoline")

    def __init__(
        self, trampoline: Trampoline, on_end: Callable[[BaseException | None], None]
    ) -> None:
        self.trampoline = trampoline
        self.on_end = on_end
        self.live: set[Task] = set()
        self.error: BaseException | None = None
        self.ended = False
        trampoline.groups += 1

    def spawn(self, coro: Coroutine[Any, Any, None]) -> Task:
        """Start ``coro`` as a task of this group; it first runs on the trampoline's next pass."""
        task = Task(coro, self)
        self.live.add(task)
        self.trampoline.wake(task, None)
        return task

    def cancel(self, error: BaseException | None = None) -> None:
        """Close every live task (their ``finally`` blocks run now) and end the group.
        Idempotent; ``error`` is what the group ends with (``None``: cancelled quietly)."""
        if self.ended:
            return
        if self.error is None:
            self.error = error
        self.ended = True
        self.trampoline.groups -= 1
        closed = list(self.live)
        for task in closed:
            task.done = True
            task.coro.close()
        self.live.clear()
        if closed and self.trampoline.on_abandon is not None:
            self.trampoline.on_abandon(closed)
        self.on_end(self.error)

    def _task_ended(self, task: Task, error: BaseException | None) -> None:
        task.done = True
        self.live.discard(task)
        if self.ended:
            return
        if error is not None:
            self.cancel(error)
        elif not self.live:
            self.ended = True
            self.trampoline.groups -= 1
            self.on_end(None)


#: Where a ``StepRequest`` goes: whoever runs it later calls ``Trampoline.wake`` with the
#: outcome.
SubmitStep = Callable[[Task, StepRequest], None]


class Trampoline:
    """Resumes ready tasks until every task waits on a condition or a step.

    ``submit`` receives each ``StepRequest`` with the task that made it; whoever runs the step
    resumes the task with ``wake(task, outputs)`` or ``wake(task, exception)``.
    """

    def __init__(self, submit: SubmitStep) -> None:
        self.submit = submit
        #: Called with the tasks a cancelled group closed while they waited, so whoever holds
        #: their steps drops them (a chunked prefill must not go on for a closed walk).
        self.on_abandon: Callable[[list[Task]], None] | None = None
        self.ready: deque[tuple[Task, Any]] = deque()
        #: Woken tasks that may wait for ``run_later``: their next step is launched already.
        self.later: deque[tuple[Task, Any]] = deque()
        self.groups = 0  # task groups (walks) not ended yet

    def wake(self, task: Task, value: Any) -> None:
        """Make ``task`` ready to resume with ``value`` (an exception is thrown into it)."""
        if not task.done:
            self.ready.append((task, value))

    def wake_later(self, task: Task, value: Any) -> None:
        """``wake``, but resumed by ``run_later`` (its driver has something better to do
        first: launch the forward that runs the task's next step)."""
        if not task.done:
            self.later.append((task, value))

    def run_later(self) -> None:
        """Resume the tasks ``wake_later`` woke, then every task that is ready. Never raises."""
        if self.later:
            self.ready.extend(self.later)
            self.later.clear()
        self.run_ready()

    def run_ready(self) -> None:
        """Resume ready tasks until none is ready. Never raises: a task's error ends its group."""
        ready = self.ready
        while ready:
            task, value = ready.popleft()
            if task.done:
                continue
            try:
                if isinstance(value, BaseException):
                    command = task.coro.throw(value)
                else:
                    command = task.coro.send(value)
            except StopIteration:
                self._ended(task, None)
                continue
            except Exception as exc:
                self._ended(task, exc)
                continue
            if isinstance(command, StepRequest):  # the most frequent, tested first
                self.submit(task, command)
            elif isinstance(command, Condition):
                command.waiters.append(task)
            else:
                error = TypeError(
                    f"walk coroutine awaited {command!r}, which the worker cannot run"
                )
                task.group._task_ended(task, error)
                task.coro.close()

    def _ended(self, task: Task, error: BaseException | None) -> None:
        task.group._task_ended(task, error)
        if task.ahead is not None and self.on_abandon is not None:
            self.on_abandon([task])  # what was launched ahead for it is not wanted now
