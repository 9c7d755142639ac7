"""The continuous-batching loop of one worker: walk coroutines and engine forwards, in rounds.

Each round: resume every walk coroutine that is ready (they run until they wait for a step, a
chunk or credit), take the round's steps from the ``Scheduler`` (token budget, KV admission),
run one forward per engine, and resume the coroutines with the outputs. Walk outputs go to their
sinks as they are made; a sink delivers them in one message per round where it crosses a
process. Requests join and leave between rounds.

A forward runs on a dedicated thread, so the event loop stays free to serve sockets and
programs while a model computes; a forward measured to take less than a thread hand-off
(``inline_below_s``, ~100 µs on small VMs) runs on the loop's thread instead, since the hop
would cost more than the work. Rounds whose forwards run inline run back to back for up to
``slice_s`` before the loop lets other tasks run, so readers take several outputs per wake-up.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus

from mstar_async.engines import Engine, Step
from mstar_async.engines.kv.handles import KeptKV
from mstar_async.errors import EngineError, MstarError, RequestCancelled
from mstar_async.graph import PortRef, WalkPlan
from mstar_async.graph.segments import Segment
from mstar_async.transport import StepCall
from mstar_async.walks.handle import RunningWalk
from mstar_async.walks.run import OUTPUT_WINDOW, WalkRun, WalkSink
from mstar_async.walks.segment import SegmentRun, SegmentSink
from mstar_async.walks.trampoline import Chain, StepRequest, Task, Trampoline
from mstar_async.worker.scheduler import BatchStats, Job, Round, Scheduler

#: Forwards measured faster than this run on the event loop's thread: a hand-off to the forward
#: thread and back costs ~100-200 µs on small VMs, more than such a forward.
INLINE_BELOW_S = 250e-6
#: How long back-to-back inline rounds may hold the event loop before others get a turn.
SLICE_S = 0.002
_EMA = 0.2  # weight of the newest forward time in the running estimate
#: How often outputs leave between inline rounds: a message a round would cost more than such
#: a round (tens of microseconds each way), one per slice would hold outputs for milliseconds.
SEND_EVERY_S = 0.0005
#: How long ``ForwardThread.start`` waits for the thread to take a job (a thread wake-up).
TAKE_WAIT_S = 0.002


T = TypeVar("T")


class ForwardThread:
    """One thread that runs forwards, handing each result back with ``call_soon_threadsafe``
    (about half the cost of a thread-pool hop on these machines).

    Build the engines on it too (``call``): every thread that runs a parallel torch op keeps
    an OpenMP team, and once the process holds more team threads than CPUs, libgomp stops
    spinning between parallel regions, so each op pays a futex wake-up. SmolLM2's int4 decode
    step took 35-45 ms on a forward thread whose engine was built on another thread, and
    16-21 ms when built on the forward thread itself (two threads, two cores).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._taken = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            fn, loop, future = item
            self._taken.set()
            try:
                fn()
            except BaseException as exc:  # handed to the awaiting loop
                loop.call_soon_threadsafe(_settle, future, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, None)

    def start(self, fn: Callable[[], None]) -> asyncio.Future[None]:
        """Start ``fn`` on the thread; the future settles when it has run (with its error).
        Returns once the thread has taken ``fn`` (or after ``TAKE_WAIT_S``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._taken.clear()
        self._jobs.put((fn, loop, future))
        # The thread needs the GIL to take the job: waiting here hands it over. Otherwise
        # Python code the caller runs next keeps it for up to the interpreter's switch
        # interval (5 ms), and the forward starts only once that code is done.
        self._taken.wait(TAKE_WAIT_S)
        return future

    async def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread and wait for it. Not cancel-safe on its own: a cancelled
        wait leaves ``fn`` running; callers wait for it to finish before touching its state."""
        await self.start(fn)

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the thread, its result or its exception. Not cancel-safe on its
        own (as ``run``)."""
        result: list[T] = []
        await self.run(lambda: result.append(fn()))
        return result[0]

    def close(self) -> None:
        """Stop the thread once the forward it runs (if any) ends."""
        self._jobs.put(None)


async def build_engines(
    factories: Mapping[str, Callable[[], Engine]],
) -> tuple[ForwardThread, dict[str, Engine]]:
    """Each factory's engine, built on a new ``ForwardThread`` that is to run their forwards
    (hand both to ``WalkLoop``). Closes the thread and re-raises if a factory fails; not
    cancel-safe beyond that (an engine being built finishes on its thread).
    """
    thread = ForwardThread("mstar-forward")
    engines: dict[str, Engine] = {}
    try:
        for name, factory in factories.items():
            engines[name] = await thread.call(factory)
    except BaseException:
        thread.close()
        raise
    return thread, engines


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class WalkLoop:
    """Runs walks and steps on one worker's engines in continuous batches.

    Start ``run()`` in a task group; then, from the same event loop, ``start_walk`` runs a walk
    here and ``submit`` runs a single step (for walks whose loops span ranks). ``max_batch_size``,
    ``max_batch_tokens`` and ``forward_time_bound_s`` bound one forward of an engine (see
    ``Scheduler``: a long prefill is cut into chunks whose forward stays under the bound).
    ``forward_thread`` is the thread the engines were built on (``ForwardThread.call``); the
    loop owns it from then on and closes it when ``run`` ends. Without it the loop makes one.

    Raises:
        ValueError: a limit is below 1.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        max_batch_tokens: int = 512,
        forward_time_bound_s: float = 0.1,
        inline_below_s: float = INLINE_BELOW_S,
        slice_s: float = SLICE_S,
        forward_thread: ForwardThread | None = None,
    ) -> None:
        self.scheduler = Scheduler(
            engines,
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            forward_time_bound_s=forward_time_bound_s,
        )
        #: The engines by name: the scheduler's own mapping, so a swapped-in engine is used.
        self.engines = self.scheduler.engines
        self.trampoline = Trampoline(self._submit_step)
        self.trampoline.on_abandon = self._abandoned
        self.inline_below_s = inline_below_s
        self.slice_s = slice_s
        self._wakeup: asyncio.Future[None] | None = None
        self._in_round = False  # between take() and finish(): engines are not to be touched
        #: Releases asked for during a round, with what their callers wait on.
        self._releases: list[tuple[str, asyncio.Future[None]]] = []
        self._estimates: dict[tuple[str, ...], float] = {}
        self._thread: ForwardThread | None = forward_thread  # the engines' own, when given
        self._progress_at = time.monotonic()  # a forward finished, or the idle loop was woken
        self._declined: list[tuple[str, Step]] = []  # steps run ahead to undo (``_decline``)
        #: Called once the walks have run, before the loop waits for a threaded forward or for
        #: work, and between inline rounds every ``SEND_EVERY_S``: a worker sends what they
        #: made from here, without a hop through the event loop first.
        self.after_walks: Callable[[], None] | None = None
        self._sent_at = 0.0

    @property
    def walks_running(self) -> int:
        """Walks started here that have not ended yet."""
        return self.trampoline.groups

    @property
    def kv_blocks_in_use(self) -> int:
        """KV blocks the engines here hold now (engines without a paged cache count 0)."""
        return sum(int(getattr(e, "blocks_in_use", 0)) for e in self.engines.values())

    @property
    def kv_handles(self) -> int:
        """KV handles the engines here keep beyond their requests (kept conversations, a
        registered voice's prompt rows)."""
        return sum(len(e.handles) for e in self.engines.values() if isinstance(e, KeptKV))

    @property
    def kv_kept_blocks(self) -> int:
        """KV blocks those handles hold (part of ``kv_blocks_in_use``)."""
        return sum(e.kept_blocks for e in self.engines.values() if isinstance(e, KeptKV))

    @property
    def stats(self) -> BatchStats:
        """Forwards, steps and batch sizes run so far."""
        return self.scheduler.stats

    @property
    def stalled_s(self) -> float:
        """Seconds this loop has had steps waiting (queued, parked, or in a forward) without a
        forward finishing; 0 while none wait. A readiness probe reads it: a forward that hangs,
        or steps that are never taken, make it grow. Never raises."""
        scheduler = self.scheduler
        if not (self._in_round or scheduler.queued or scheduler.parked):
            return 0.0
        return time.monotonic() - self._progress_at

    # --- what the conductor (or a worker's message loop) calls -------------------------------

    def start_walk(
        self,
        plan: WalkPlan,
        request_id: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkSink,
        *,
        window: int = OUTPUT_WINDOW,
        segment: Segment | None = None,
    ) -> WalkRun:
        """Start running walk ``plan`` for ``request_id`` here; its outputs and end go to
        ``sink``. With ``segment``, only this rank's part of a walk that spans ranks runs here
        (a ``SegmentRun``, and ``sink`` must be a ``SegmentSink``). Returns the run
        (``cancel()``, ``ack(n)``; call ``kick()`` after either). Never raises: errors reach
        the sink."""
        run: WalkRun
        if segment is None:
            run = WalkRun(
                plan, request_id, inputs, params, persisted, self.trampoline, sink, window=window
            )
        else:
            assert isinstance(sink, SegmentSink)
            run = SegmentRun(
                plan,
                request_id,
                inputs,
                params,
                persisted,
                self.trampoline,
                sink,
                segment,
                window=window,
            )
        run.start()
        self.kick()
        return run

    def open_walk(
        self,
        request_id: str,
        plan: WalkPlan,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkSink,
    ) -> RunningWalk:
        """``start_walk`` for the conductor (see ``WalkHost``); never raises."""
        run = self.start_walk(plan, request_id, inputs, params, persisted, sink)
        return RunningWalk(run, self.kick)

    def kick(self) -> None:
        """Wake the loop: something it waits for may have changed (a walk, credit, a cancel)."""
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            # The loop was idle: whatever it is woken for has waited from now, not from the
            # last forward before it went idle.
            self._progress_at = time.monotonic()
            waiter.set_result(None)

    async def submit(self, call: StepCall) -> dict[str, Any]:
        """Queue one step and wait for its outputs.

        Cancel-safe: a cancelled submit's outputs are dropped; ``release`` of its request
        removes the step if it is still queued.

        Raises:
            EngineError: the engine is unknown here, or the forward failed (its cause attached).
            RequestCancelled: the request was released while the step waited.
        """
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        job = Job(call.engine, Step(call.request_id, call.op, call.inputs), future)
        self.scheduler.submit(job)
        self.kick()
        try:
            return await future
        except BaseException:
            self.scheduler.withdraw(job)
            raise

    async def release(self, request_id: str) -> None:
        """The request is over: drop its queued steps and tell every engine to free what it
        holds for it, at once or, while a round is in flight, as soon as that round ends (the
        loop does it before it takes the next one). Shielded: a release always completes.
        """
        with anyio.CancelScope(shield=True):
            if self._in_round:
                done = asyncio.get_running_loop().create_future()
                self._releases.append((request_id, done))
                await done
            else:
                self._release_now(request_id)
        self.kick()

    def _release_now(self, request_id: str) -> None:
        for job in self.scheduler.cancel(request_id):
            self._resume(job, None)
        self._discard_declined()  # before a sequence is kept past its request
        self.scheduler.release(request_id)

    def _release_waiting(self) -> None:
        # Between rounds: the loop goes on to the next round without yielding, so a release
        # waiting for a gap between rounds would wait until the engine went idle.
        releases, self._releases = self._releases, []
        for request_id, done in releases:
            try:
                self._release_now(request_id)
            except Exception as exc:  # the caller's to raise, as a release made at once would
                _settle(done, exc)
            else:
                _settle(done, None)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve walks and steps until cancelled.

        Cancel-safe: a forward in flight on the forward thread finishes there; the loop stops.
        """
        if self._thread is None:
            self._thread = ForwardThread("mstar-forward")
        task_status.started()
        try:
            await self._rounds()
        finally:
            # Stopping: a forward may still run on the thread, so the engines are left alone;
            # whoever waits for a release goes on (the engines go with the loop).
            for _, done in self._releases:
                _settle(done, None)
            self._releases.clear()
            self._thread.close()

    async def _rounds(self) -> None:
        slice_start = time.perf_counter()
        while True:
            self.trampoline.run_ready()
            if not self.scheduler.has_work:
                if self.trampoline.later:
                    self.trampoline.run_later()  # what ran ahead for them was withdrawn
                    continue
                self._send_outputs()
                await self._idle()
                slice_start = time.perf_counter()
                continue
            now = time.perf_counter()
            if now - slice_start > self.slice_s:
                await asyncio.sleep(0)  # inline rounds have held the loop long enough
                slice_start = time.perf_counter()
                continue
            if now - self._sent_at > SEND_EVERY_S:
                self._send_outputs()
            batch = self.scheduler.take()
            self._in_round = True
            try:
                if await self._forward(batch):
                    slice_start = time.perf_counter()
                finished = self.scheduler.finish(batch)
            finally:
                self._in_round = False
            self._progress_at = time.monotonic()
            for job, outcome in finished:
                self._resume(job, outcome)
            if self._releases:
                self._release_waiting()

    async def _idle(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._wakeup = waiter
        try:
            await waiter
        finally:
            self._wakeup = None

    async def _forward(self, batch: Round) -> bool:
        """Run the round's forwards; True when they ran on the forward thread."""
        key = tuple(b.engine for b in batch.batches)
        estimate = self._estimates.get(key)
        threaded = estimate is None or estimate >= self.inline_below_s
        took = 0.0

        def forward() -> None:
            nonlocal took
            # Timed where it runs: a threaded forward's time must not include the hand-off,
            # or a forward once sent to the thread would look too slow ever to come back.
            start = time.perf_counter()
            try:
                self.scheduler.forward(batch)
            finally:
                took = time.perf_counter() - start

        self._discard_declined()  # no forward runs now, and the next one must see it undone
        if threaded:
            assert self._thread is not None
            running = self._thread.start(forward)
            # Walks whose next step is in this forward already (launched ahead) take their
            # last outputs now, off the forward's critical path.
            self.trampoline.run_later()
            self._send_outputs()
            await running
        else:
            forward()
            self.trampoline.run_later()
        self._estimates[key] = took if estimate is None else estimate + _EMA * (took - estimate)
        return threaded

    def _send_outputs(self) -> None:
        if self.after_walks is not None:
            self._sent_at = time.perf_counter()
            self.after_walks()

    def _abandoned(self, tasks: list[Task]) -> None:
        # A cancelled walk's steps leave the queue now, not when its request is released: a
        # long prefill would otherwise go on chunk after chunk until the release arrived.
        for task in tasks:
            if task.ahead is not None:
                self._decline(task.ahead)
                task.ahead = None
        if self.scheduler.withdraw_owned(set(tasks)):
            self.kick()

    def _decline(self, job: _WalkJob) -> None:
        """The walk will not take ``job``, launched ahead for it: out of the queue, and what
        it did undone (``discard``; a no-op for a step that never ran) before the engine's
        next forward."""
        self.scheduler.withdraw(job)
        if hasattr(self.engines.get(job.engine), "discard"):
            self._declined.append((job.engine, job.step))

    def _discard_declined(self) -> None:
        # Between forwards (as ``release``): an engine is never touched beside its forward.
        if not self._declined:
            return  # the usual round: nothing was launched ahead in vain
        declined, self._declined = self._declined, []
        for name, step in declined:
            discard = getattr(self.engines.get(name), "discard", None)
            if discard is not None:
                discard(step)

    def _submit_step(self, task: Task, request: StepRequest) -> None:
        ahead: _WalkJob | None = task.ahead
        if ahead is not None:
            task.ahead = None
            if ahead.answers(request):
                ahead.chain = request.chain
                if ahead.outcome is not None:  # else it is queued or running: resumed then
                    self._resume(ahead, ahead.outcome)
                return
            self._decline(ahead)  # the walk went another way (its loop ended)
        step = Step(request.request_id, request.op, request.inputs)
        try:
            self.scheduler.submit(_WalkJob(request.engine, step, task, request.chain))
        except MstarError as exc:
            self.trampoline.wake(task, exc)

    def _run_ahead(self, job: _WalkJob, task: Task, outputs: dict[str, Any]) -> bool:
        """Queue the step the walk will ask for next if its loop goes on (``StepRequest.chain``)
        where the engine keeps nothing of a step or can undo one (see ``Engine``); True if it
        did. The walk resumes after the next forward has started (``wake_later``), so its
        outputs and ``until`` are worked out while the engine runs that step."""
        chain = job.chain
        if chain is None or not _runs_ahead(self.engines.get(job.engine)):
            return False
        inputs = dict(job.step.inputs)
        for output, port in chain:
            if output not in outputs:
                return False  # the walk fails on it as it resumes
            inputs[port] = outputs[output]
        step = Step(job.step.request_id, job.step.op, inputs, ahead=True)
        ahead = _WalkJob(job.engine, step, task, chain)
        try:
            self.scheduler.submit(ahead)
        except MstarError:
            return False  # the engine was swapped out: the walk asks for itself
        task.ahead = ahead
        return True

    def _resume(self, job: Job, outcome: dict[str, Any] | BaseException | None) -> None:
        if isinstance(outcome, BaseException):
            outcome = _engine_error(job.engine, outcome)
        owner = job.owner
        if isinstance(owner, Task):
            if outcome is None:
                return  # the walk is being cancelled with its request
            if isinstance(job, _WalkJob):
                if owner.ahead is job:
                    job.outcome = outcome  # ran ahead: kept until the walk asks for it
                    return
                if isinstance(outcome, dict) and not owner.done:
                    if self._run_ahead(job, owner, outcome):
                        self.trampoline.wake_later(owner, outcome)
                        return
            self.trampoline.wake(owner, outcome)
        elif isinstance(owner, asyncio.Future) and not owner.done():
            if outcome is None:
                # An error, never ``cancel()``: a natively cancelled future cancels the task
                # awaiting it, and anyio then cancels that task's whole group (the worker's).
                owner.set_exception(_released(job))
            elif isinstance(outcome, BaseException):
                owner.set_exception(outcome)
            else:
                owner.set_result(outcome)


def _runs_ahead(engine: Engine | None) -> bool:
    # See the ``Engine`` docstring: nothing to undo, or a way to undo it.
    return bool(getattr(engine, "stateless_steps", False)) or hasattr(engine, "discard")


@dataclass(slots=True, eq=False)
class _WalkJob(Job):
    """A walk's step: the chain to its next step, if any, and, for a step launched ahead of
    its walk (``WalkLoop._run_ahead``), its outcome once it ran."""

    chain: Chain | None = None
    outcome: dict[str, Any] | BaseException | None = None

    def answers(self, request: StepRequest) -> bool:
        """Whether this step is the one ``request`` asks for: the same engine, op and inputs
        (the very objects: the walk passes on the outputs it was given)."""
        step = self.step
        if request.engine != self.engine or request.op != step.op:
            return False
        mine, theirs = step.inputs, request.inputs
        return len(mine) == len(theirs) and all(
            name in mine and mine[name] is value for name, value in theirs.items()
        )


def _released(job: Job) -> RequestCancelled:
    step = job.step
    return RequestCancelled(
        f"request {step.request_id} was released before its {step.op!r} step on engine "
        f"{job.engine!r} ran"
    )


def _engine_error(name: str, exc: BaseException) -> BaseException:
    if isinstance(exc, MstarError) or not isinstance(exc, Exception):
        return exc
    error = EngineError(f"engine {name!r} failed: {exc!r}")
    error.__cause__ = exc
    return error
