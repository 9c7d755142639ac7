"""The synchronous core of a worker's continuous batching: which queued steps run in a round,
one forward per engine, and what becomes of each step's outcome.

Pure: no asyncio, no threads, no sockets; torch only through the engines. A driver (the asyncio
``WalkLoop``) submits jobs, cancels and releases
requests, and runs rounds: ``take`` chooses, ``forward`` runs the engines (it may run on another
thread), ``finish`` resolves. The rules of a round:

- per engine, one-token steps (decodes) first, then longer ones with the tokens left, so a long
  prompt is split into chunks and never starves running decodes; ``max_batch_tokens`` and
  ``max_batch_size`` cap a forward, and a forward-time limit caps its tokens further (see
  ``ForwardTimer``);
- an outcome of ``None`` (progress made) puts the job back at the front of the queue; ``WAIT``
  does too, unless nothing of that engine's forward could run: then its jobs are parked until
  some request is released, or, when no other request holds memory there that a release could
  free, the newest is failed with ``KVCacheFull`` so no job is parked forever;
- state moves between ranks (``EXPORT_OP`` / ``IMPORT_OP`` / ``DROP_OP``) go through the
  optional ``MovableState`` protocol's ``export_state`` / ``import_state`` (and ``release``)
  instead of a forward; an import that finds no room waits like a step (``WAIT``): the moved
  state counts against this worker's memory as any request's does.

The queue is a FIFO ``deque``: the oldest job is served first so no request starves.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar_async.engines import WAIT, Engine, MovableState, Step, StepResult
from mstar_async.errors import EngineError, KVCacheFull, MstarError
from mstar_async.transport.messages import DROP_OP, EXPORT_OP, IMPORT_OP

__all__ = ["Batch", "BatchStats", "ForwardTimer", "Job", "Outcome", "Round", "Scheduler"]

#: What ``finish`` reports for a job: its outputs, or the error that failed it.
Outcome = dict[str, Any] | BaseException

_MOVES = (EXPORT_OP, IMPORT_OP, DROP_OP)


@dataclass(slots=True, eq=False)
class Job:
    """One step for one engine; ``owner`` is opaque to the scheduler (who to resume)."""

    engine: str
    step: Step
    owner: Any = None


@dataclass
class BatchStats:
    """What ran: forwards, steps, and how many forwards had each batch size."""

    forwards: int = 0
    steps: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)

    @property
    def max_batch(self) -> int:
        """The largest batch any forward saw (0 before the first)."""
        return max(self.batch_sizes, default=0)


@dataclass(slots=True, eq=False)
class Batch:
    """One engine's share of a round: its jobs (each step's ``budget`` set), and after
    ``forward`` their outcomes, the forward's tokens and wall time."""

    engine: str
    jobs: list[Job]
    costs: list[int] = field(default_factory=list)  # each job's cost when it was chosen
    outcomes: list[StepResult] = field(default_factory=list)
    ran: int = 0  # steps that went through ``engine.forward`` (state moves do not)
    freed: bool = False  # a ``DROP_OP`` released memory
    short_steps: int = 0  # one-token steps the forward ran
    long_tokens: int = 0  # tokens the forward computed for longer steps
    seconds: float = 0.0


@dataclass(slots=True, eq=False)
class Round:
    """The jobs ``take`` chose, per engine."""

    batches: list[Batch] = field(default_factory=list)

    @property
    def jobs(self) -> list[Job]:
        """Every job of the round, engine by engine."""
        return [job for batch in self.batches for job in batch.jobs]


class _Line:
    """``seconds ~ fixed + per_token * tokens`` fitted by least squares over exponential moving
    averages (``weight`` is the newest point's share).

    Why a line and not the mean time per token: a forward has a fixed cost (launches, Python);
    charging it to the tokens would make small chunks look slow per token, shrink the next
    chunk, and spiral down to one-token prefills wherever that cost nears the bound. Until the
    points differ in size the whole time counts per token (the cautious guess), and ``varied``
    says so.
    """

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.points = 0
        self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.points == 0 else self.weight
        self._n += w * (tokens - self._n)
        self._t += w * (seconds - self._t)
        self._nn += w * (tokens * tokens - self._nn)
        self._nt += w * (tokens * seconds - self._nt)
        self.points += 1

    @property
    def mean_tokens(self) -> float:
        return self._n

    @property
    def varied(self) -> bool:
        """Whether the recent points differ in size enough to fit a slope (a spread of about
        a tenth of their mean size)."""
        return self._nn - self._n * self._n > 0.01 * self._n * self._n + 1e-6

    def shift(self, seconds: float) -> None:
        """Add ``seconds`` to every point's time (the line moves, its slope stays)."""
        self._t += seconds
        self._nt += seconds * self._n

    def estimate(self) -> tuple[float, float] | None:
        if self.points == 0 or self._n <= 0:
            return None
        if not self.varied:
            return 0.0, self._t / self._n
        var = self._nn - self._n * self._n
        per_token = (self._nt - self._n * self._t) / var
        return max(0.0, self._t - per_token * self._n), per_token


class ForwardTimer:
    """One engine's forward times, learnt from its forwards: a decode round's (one-token steps
    only, a moving average), and what long steps' tokens add to a forward, as two lines (fixed
    + per token): one for forwards of long steps alone, one for long steps beside decodes, over
    the decode round's time. Why two: beside decodes, a decode round carries what any forward
    costs (reading the weights), and one line cannot fit points that carry that cost and
    points that do not.

    The time a forward may take (``time_limit``) is the bound, except where a decode round
    alone comes near it: then a forward may take a decode round and a quarter, so prompts
    always get a share of the engine beside the decodes (on a slow machine a strict bound
    would feed a prompt a few tokens per round and keep the batch from ever filling); without
    decodes, two. Where decodes are fast, a forward with decodes takes at most a decode round
    and a half, so a long prompt arriving costs running requests less than 3x their inter-token
    latency even where a forward runs up to twice its estimate (one forward's own time varies
    that much on a small shared VM).
    """

    def __init__(self, weight: float = 0.25) -> None:
        self.weight = weight
        #: A forward of one-token steps only, in seconds (None before the first).
        self.decode_s: float | None = None
        #: The tokens of long steps in the latest forward that had any.
        self.last_tokens = 0
        self._alone = _Line(weight)
        self._beside = _Line(weight)

    def observe(self, short_steps: int, long_tokens: int, seconds: float) -> None:
        """Add one forward of ``short_steps`` one-token steps and ``long_tokens`` tokens of
        longer steps that took ``seconds``."""
        d = self.decode_s
        if long_tokens == 0:
            if short_steps:
                self.decode_s = seconds if d is None else d + self.weight * (seconds - d)
                if d is None:  # the forwards beside decodes seen so far, over this round now
                    self._beside.shift(-self.decode_s)
            return
        self.last_tokens = long_tokens
        if short_steps:
            self._beside.observe(long_tokens, max(0.0, seconds - (d or 0.0)))
        else:
            self._alone.observe(long_tokens, seconds)

    def _line(self, decoding: bool) -> _Line:
        own, other = (self._beside, self._alone) if decoding else (self._alone, self._beside)
        return own if own.points or not other.points else other

    def estimate(self, decoding: bool = False) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds that long steps' tokens add to a forward with
        decodes (over the decode round) or without, or None before the first forward with any.
        Where only the other kind was seen, its slope serves: beside decodes with no fixed
        part of its own, alone with the decode round's as its fixed part."""
        line = self._line(decoding)
        estimate = line.estimate()
        if estimate is None:
            return None
        fixed, per_token = estimate
        if line is self._alone and decoding:
            return 0.0, per_token
        if line is self._beside and not decoding:
            return fixed + (self.decode_s or 0.0), per_token
        return fixed, per_token

    def time_limit(self, bound_s: float, decoding: bool) -> float:
        """The seconds a forward may take under ``bound_s`` (see the class docstring), with
        or without one-token steps in it."""
        d = self.decode_s
        if d is None:
            return bound_s
        if decoding:
            return max(1.25 * d, min(bound_s, 1.5 * d))
        return max(bound_s, 2 * d)

    def tokens_within(self, bound_s: float, decoding: bool = False) -> int | None:
        """The most tokens of long steps a forward may take to stay within its time limit
        under ``bound_s``, or None before any forward with long steps (nothing known yet).

        Where the timer cannot tell yet what a token costs (chunks of one size so far, or
        points that give no slope), a chunk half as large again is tried, to learn it; where
        a fixed cost alone passes the limit, a chunk costs at most that fixed cost again. A
        chunk is never more than half as large again as the last one.
        """
        estimate = self.estimate(decoding)
        if estimate is None:
            return None
        fixed, per_token = estimate
        line = self._line(decoding)
        # The latest chunk of either kind: a large one alone long ago says nothing of the
        # chunks beside decodes now (Hypothesis found a one-token chunk followed by 258).
        probe = max(2, (3 * self.last_tokens + 1) // 2)
        if per_token <= 0:
            return probe
        base = self.decode_s if decoding and self.decode_s is not None else 0.0
        room = self.time_limit(bound_s, decoding) - base - fixed
        if line.varied:
            # At most half as large again as the last chunk: a slope fitted from a few noisy
            # points can be near zero for a while, and a grant from it hundreds of times big.
            tokens = _fit(room, per_token) if room > 0 else max(1, _fit(fixed, per_token))
            return min(tokens, probe)
        # Chunks of one size so far: all their time is charged per token, which cannot tell a
        # fixed cost from a cost per token. Those that fit keep their size; one- or two-token
        # chunks that do not are tried larger.
        mean = line.mean_tokens
        if mean * per_token <= room * 1.001:
            return max(_fit(room, per_token), int(mean))
        return probe if mean <= 2 else max(0, _fit(room, per_token))


def _fit(seconds: float, per_token: float) -> int:
    # Estimates carry rounding error: 1.9999999 tokens' worth of time is two tokens.
    return int(seconds / per_token + 1e-6)


class Scheduler:
    """Queues jobs for a worker's engines and runs them in rounds (see the module docstring).

    Not thread-safe: call everything but ``forward`` (and ``release_engines``) from one thread.
    ``forward`` touches only the engines and the ``Round``, so it may run on another thread,
    one at a time and never beside ``release_engines``. ``clock`` times forwards (inject a
    fake one in tests).

    Raises:
        ValueError: a limit is below 1 or the time bound is not positive.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        max_batch_tokens: int = 512,
        forward_time_bound_s: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or not forward_time_bound_s > 0:
            raise ValueError(
                f"max_batch_size and max_batch_tokens must be >= 1 and forward_time_bound_s > 0, "
                f"got {max_batch_size}, {max_batch_tokens} and {forward_time_bound_s}"
            )
        # Why the same dict for the life of the scheduler: drivers and tests may swap an engine
        # in between rounds; each forward looks its engine up.
        self.engines: dict[str, Engine] = dict(engines)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.forward_time_bound_s = forward_time_bound_s
        self.clock = clock
        self.stats = BatchStats()
        self.timers: dict[str, ForwardTimer] = {}
        self._queue: deque[Job] = deque()
        self._parked: list[Job] = []
        self._in_flight: set[Job] = set()
        self._withdrawn: set[Job] = set()
        self._whole: set[tuple[str, str]] = set()  # (engine, op) whose steps never split
        self._holders: dict[str, set[str]] = {}  # engine -> requests that ran there, not released

    @property
    def has_work(self) -> bool:
        """Whether runnable (queued, not parked) jobs exist."""
        return bool(self._queue)

    @property
    def queued(self) -> int:
        """Jobs waiting for a round (parked ones not counted)."""
        return len(self._queue)

    @property
    def parked(self) -> list[Job]:
        """Jobs parked until a release, oldest first (a copy)."""
        return list(self._parked)

    def submit(self, job: Job) -> None:
        """Queue ``job`` at the back.

        Raises:
            EngineError: no engine of that name here (the message lists the engines).
        """
        if job.engine not in self.engines:
            raise EngineError(
                f"no engine {job.engine!r} on this worker; engines: {sorted(self.engines)}"
            )
        self._queue.append(job)

    def withdraw(self, job: Job) -> bool:
        """Take back one job: True if it was queued or parked (it never runs again); False if
        it is in a forward now (its outcome is dropped when the round finishes) or done."""
        if job in self._in_flight:
            self._withdrawn.add(job)
            return False
        if job in self._parked:
            self._parked.remove(job)
            return True
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def withdraw_owned(self, owners: set[Any]) -> int:
        """``withdraw`` every job whose owner is in ``owners`` (queued, parked or in a forward
        now); returns how many. Never raises."""
        found = [j for j in (*self._queue, *self._parked, *self._in_flight) if j.owner in owners]
        for job in found:
            self.withdraw(job)
        return len(found)

    def cancel(self, request_id: str) -> list[Job]:
        """Remove ``request_id``'s queued and parked jobs and return them (queued ones first,
        each group in order). Its jobs in a forward now are not returned: their outcomes are
        dropped at ``finish``. The request still holds its engines' memory until ``release``.
        Never raises."""
        removed = [j for j in (*self._queue, *self._parked) if j.step.request_id == request_id]
        for job in removed:
            self.withdraw(job)
        self._withdrawn.update(j for j in self._in_flight if j.step.request_id == request_id)
        return removed

    def release(self, request_id: str) -> None:
        """``release_engines`` then ``mark_released``: every engine drops the request, and
        parked jobs become runnable again.

        Raises:
            What an engine's ``release`` raised (the first; every engine is still called).
        """
        try:
            self.release_engines(request_id)
        finally:
            self.mark_released(request_id)

    def release_engines(self, request_id: str) -> None:
        """Call ``release(request_id)`` on every engine; touches nothing of the scheduler, so a
        driver may run it on its forward thread (never beside a ``forward``).

        Raises:
            What an engine's ``release`` raised (the first; every engine is still called).
        """
        error: Exception | None = None
        for engine in self.engines.values():
            try:
                engine.release(request_id)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def mark_released(self, request_id: str) -> None:
        """The scheduler's side of a release: the request holds nothing now, and every parked
        job goes back to the front of the queue (memory may be free for it)."""
        for holders in self._holders.values():
            holders.discard(request_id)
        self.wake()

    def wake(self) -> None:
        """Parked jobs go back to the front of the queue: memory was freed (a release, or an
        engine's KV handle dropped outside any request)."""
        self._queue.extendleft(reversed(self._parked))
        self._parked.clear()

    def take(self) -> Round:
        """Choose this round's jobs, per engine, and set each step's ``budget``; they leave
        the queue until ``finish``. An engine's ``cost`` that raises counts 1 (the forward
        reports the error)."""
        queued: dict[str, list[Job]] = {}
        for job in self._queue:
            queued.setdefault(job.engine, []).append(job)
        chosen = Round([self._choose(name, jobs) for name, jobs in queued.items()])
        taken = set(chosen.jobs)
        if len(taken) == len(self._queue):
            self._queue = deque()  # the usual round: every queued step runs
        else:
            self._queue = deque(j for j in self._queue if j not in taken)
        self._in_flight |= taken
        return chosen

    def forward(self, round: Round) -> None:
        """Run one forward per engine of ``round`` (state moves through the engine protocol)
        and record the outcomes in it. Never raises: an engine's error becomes every one of its
        steps' outcome. Touches only the engines and ``round`` (see the class docstring)."""
        for batch in round.batches:
            engine = self.engines[batch.engine]
            run: list[int] = []
            for k, job in enumerate(batch.jobs):
                if job.step.op in _MOVES:
                    batch.outcomes[k] = _move_state(engine, job.step)
                    batch.freed |= job.step.op == DROP_OP
                else:
                    run.append(k)
            if run:
                self._forward_one(batch, engine, run)

    def finish(self, round: Round) -> list[tuple[Job, Outcome]]:
        """Resolve ``round`` after ``forward``: return the jobs that completed (outputs) or
        failed (an ``MstarError``; anything else wrapped in ``EngineError``), in round order.
        Unfinished jobs go back to the front of the queue; parked ones wait for a release.
        Withdrawn jobs are dropped."""
        done: list[tuple[Job, Outcome]] = []
        again: list[Job] = []
        for batch in round.batches:
            self._in_flight.difference_update(batch.jobs)
            self._account(batch)
            if batch.freed:
                self.wake()
            live = list(zip(batch.jobs, batch.outcomes, strict=True))
            if self._withdrawn:
                live = [(job, outcome) for job, outcome in live if job not in self._withdrawn]
                self._withdrawn.difference_update(batch.jobs)
            if live and all(outcome is WAIT for _, outcome in live):
                self._stalled(batch.engine, [job for job, _ in live], done, again)
                continue
            for job, outcome in live:
                if outcome is None or outcome is WAIT:
                    again.append(job)
                else:
                    done.append((job, _outcome(batch.engine, outcome)))
        self._queue.extendleft(reversed(again))
        return done

    def run_round(self) -> list[tuple[Job, Outcome]]:
        """``take``, ``forward`` and ``finish`` one round on this thread."""
        chosen = self.take()
        self.forward(chosen)
        return self.finish(chosen)

    def _choose(self, name: str, candidates: list[Job]) -> Batch:
        """One-token steps first, then longer ones with the tokens left (within the time
        bound's grant, but never below the one-token steps or one token for a long step; with
        no time grant while long steps outnumber the one-token ones beside them).

        Steps of an op the engine runs whole whatever their budget (seen once finishing on
        less) are held to ``max_batch_tokens`` only: a smaller grant would not shorten their
        forward, it would only split a batch that belongs together (guidance branches).
        """
        engine = self.engines[name]
        costs = [1 if j.step.op in _MOVES else _cost(engine, j.step) for j in candidates]
        # When more requests wait for a long step (a prompt) than run one-token steps beside
        # them, most of the engine's users wait for their first output: serve them in full
        # chunks (the limit protects the pace of running requests, here the minority). With
        # nothing running the limit stays: it bounds how long a cancel waits.
        waiting = sum(cost > 1 for cost in costs)
        prompts_first = 0 < len(costs) - waiting < waiting
        chosen: list[Job] = []
        chosen_costs: list[int] = []
        tokens = 0
        limit = self.max_batch_tokens
        for short in (True, False):
            if not short:
                if not waiting:
                    break  # a round of one-token steps only: no second pass, no time estimate
                if not prompts_first:
                    limit = self._long_limit(name, tokens)
            for job, cost in zip(candidates, costs, strict=True):
                if (cost == 1) != short:
                    continue
                whole = (name, job.step.op) in self._whole
                grant = min(cost, (self.max_batch_tokens if whole else limit) - tokens)
                if grant < 1 or len(chosen) >= self.max_batch_size:
                    break
                job.step.budget = grant
                tokens += grant
                chosen.append(job)
                chosen_costs.append(cost)
        return Batch(name, chosen, chosen_costs, [None] * len(chosen))

    def _long_limit(self, name: str, tokens: int) -> int:
        timer = self.timers.get(name)
        cap = None if timer is None else timer.tokens_within(self.forward_time_bound_s, tokens > 0)
        if cap is None:
            return self.max_batch_tokens
        # ``cap`` counts the long steps' tokens only: the one-token steps chosen come on top.
        return min(self.max_batch_tokens, tokens + max(cap, 1))

    def _forward_one(self, batch: Batch, engine: Engine, run: list[int]) -> None:
        steps = [batch.jobs[k].step for k in run]
        started = self.clock()
        try:
            results = engine.forward(steps)
            if len(results) != len(steps):
                raise EngineError(
                    f"engine {batch.engine!r} returned {len(results)} results for "
                    f"{len(steps)} steps"
                )
        except Exception as exc:
            results = [exc] * len(steps)
        batch.seconds = self.clock() - started
        batch.ran = len(steps)
        for k, result in zip(run, results, strict=True):
            batch.outcomes[k] = result
            cost = batch.costs[k]
            if cost == 1:
                batch.short_steps += result is not WAIT
            else:
                batch.long_tokens += _computed(cost, batch.jobs[k].step.budget, result)

    def _account(self, batch: Batch) -> None:
        if not batch.ran:
            return
        self.stats.forwards += 1
        self.stats.steps += batch.ran
        self.stats.batch_sizes[batch.ran] += 1
        if batch.short_steps or batch.long_tokens:
            timer = self.timers.setdefault(batch.engine, ForwardTimer())
            timer.observe(batch.short_steps, batch.long_tokens, batch.seconds)
        for job, cost, outcome in zip(batch.jobs, batch.costs, batch.outcomes, strict=True):
            if isinstance(outcome, dict) and job.step.budget < cost:
                self._whole.add((batch.engine, job.step.op))
        # A step that waited took nothing (engines allocate only for steps that run), so only
        # a request whose step ran may hold memory a release of it would free.
        holders = self._holders.setdefault(batch.engine, set())
        holders.update(
            job.step.request_id
            for job, outcome in zip(batch.jobs, batch.outcomes, strict=True)
            if outcome is not WAIT
        )

    def _stalled(
        self, name: str, jobs: list[Job], done: list[tuple[Job, Outcome]], again: list[Job]
    ) -> None:
        """Nothing of an engine's forward could run for lack of memory: park its jobs until a
        release, unless no request outside them holds memory there that a release could free
        (requests whose own jobs are parked free nothing): then fail the newest alone."""
        waiting = {job.step.request_id for job in jobs}
        waiting |= {job.step.request_id for job in self._parked if job.engine == name}
        if self._holders.get(name, set()) - waiting:
            self._parked.extend(jobs)
            return
        victim = jobs[-1]
        done.append((victim, _stuck(name, victim.step)))
        again.extend(jobs[:-1])


def _cost(engine: Engine, step: Step) -> int:
    try:
        return max(1, int(engine.cost(step)))
    except Exception:
        return 1  # the forward reports the step's error


def _computed(cost: int, budget: int, result: StepResult) -> int:
    """Tokens a step computed in a forward, for its timing: a finished step did all it had
    left (a step that cannot be split runs whole, whatever its budget); an unfinished one its
    budget; a waiting one nothing."""
    if result is WAIT:
        return 0
    return cost if isinstance(result, dict) else min(cost, budget)


def _move_state(engine: Engine, step: Step) -> StepResult:
    """A request's state leaving this engine (a copy), arriving (``WAIT`` while there is no
    room), or dropped here once it has arrived elsewhere. An engine that is not
    ``MovableState`` holds nothing to move: it exports ``None`` and imports only ``None``."""
    rid = step.request_id
    try:
        if step.op == DROP_OP:
            engine.release(rid)
        elif step.op == EXPORT_OP:
            if isinstance(engine, MovableState):
                return {"state": engine.export_state(rid)}
            return {"state": None}
        elif isinstance(engine, MovableState):
            engine.import_state(rid, step.inputs.get("state"))
        elif step.inputs.get("state") is not None:
            raise EngineError(f"request {rid}: this engine takes no state from another rank")
        return {}
    except KVCacheFull as exc:
        return WAIT if step.op == IMPORT_OP else exc
    except Exception as exc:
        return exc


def _outcome(name: str, result: StepResult) -> Outcome:
    if isinstance(result, dict):
        return result
    if isinstance(result, MstarError):
        return result
    error = EngineError(f"engine {name!r} failed: {result!r}")
    if isinstance(result, BaseException):
        error.__cause__ = result
    return error


def _stuck(name: str, step: Step) -> KVCacheFull:
    return KVCacheFull(
        f"request {step.request_id}: its {step.op} step on engine {name!r} waits for memory "
        "that no other request holds or will release, so it failed instead of waiting forever; "
        "give the engine more memory or send smaller requests"
    )
