"""Temporary scheduler core (interface stand-in)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar_async.engines import WAIT, Engine, Step, StepResult
from mstar_async.errors import EngineError
from mstar_async.transport import EXPORT_OP, IMPORT_OP


@dataclass(slots=True, eq=False)
class Job:
    engine: str
    step: Step
    owner: Any = None


@dataclass
class BatchStats:
    forwards: int = 0
    steps: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes, default=0)


@dataclass(eq=False)
class Round:
    batches: dict[str, list[Job]]
    outcomes: dict[int, StepResult] = field(default_factory=dict)

    @property
    def engine_names(self) -> tuple[str, ...]:
        return tuple(name for name, jobs in self.batches.items() if jobs)


class Scheduler:
    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_batch_size: int = 256,
        max_batch_tokens: int = 512,
        forward_time_bound_s: float = 0.1,
    ) -> None:
        self.engines = dict(engines)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.stats = BatchStats()
        self._queue: deque[Job] = deque()
        self._parked: list[Job] = []

    def submit(self, job: Job) -> None:
        if job.engine not in self.engines:
            raise EngineError(
                f"no engine {job.engine!r} on this worker; engines: {sorted(self.engines)}"
            )
        self._queue.append(job)

    def cancel(self, request_id: str) -> list[Job]:
        gone = [j for j in self._queue if j.step.request_id == request_id]
        gone += [j for j in self._parked if j.step.request_id == request_id]
        self._queue = deque(j for j in self._queue if j.step.request_id != request_id)
        self._parked = [j for j in self._parked if j.step.request_id != request_id]
        return gone

    def release(self, request_id: str) -> None:
        for engine in self.engines.values():
            engine.release(request_id)
        if self._parked:
            self._queue.extendleft(reversed(self._parked))
            self._parked.clear()

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    def take(self) -> Round:
        queued: dict[str, list[Job]] = {}
        for job in self._queue:
            queued.setdefault(job.engine, []).append(job)
        batches: dict[str, list[Job]] = {}
        for name, candidates in queued.items():
            engine = self.engines[name]
            costs = [max(1, engine.cost(j.step)) for j in candidates]
            chosen: list[Job] = []
            tokens = 0
            for short in (True, False):
                for job, cost in zip(candidates, costs, strict=True):
                    if (cost == 1) != short or len(chosen) >= self.max_batch_size:
                        continue
                    grant = min(cost, self.max_batch_tokens - tokens)
                    if grant < 1:
                        break
                    job.step.budget = grant
                    tokens += grant
                    chosen.append(job)
            batches[name] = chosen
        taken = {id(j) for jobs in batches.values() for j in jobs}
        self._queue = deque(j for j in self._queue if id(j) not in taken)
        return Round(batches)

    def forward(self, batch: Round) -> None:
        for name, jobs in batch.batches.items():
            if jobs:
                self._forward_one(name, jobs, batch.outcomes)

    def _forward_one(self, name: str, jobs: list[Job], out: dict[int, StepResult]) -> None:
        engine = self.engines[name]
        run = []
        for job in jobs:
            if job.step.op == EXPORT_OP:
                export = getattr(engine, "export_state", None)
                out[id(job)] = {"state": None if export is None else export(job.step.request_id)}
            elif job.step.op == IMPORT_OP:
                imp = getattr(engine, "import_state", None)
                if imp is not None:
                    imp(job.step.request_id, job.step.inputs.get("state"))
                out[id(job)] = {}
            else:
                run.append(job)
        if not run:
            return
        self.stats.forwards += 1
        self.stats.steps += len(run)
        self.stats.batch_sizes[len(run)] += 1
        try:
            results = engine.forward([j.step for j in run])
            if len(results) != len(run):
                raise EngineError(
                    f"engine {name!r} returned {len(results)} results for {len(run)} steps"
                )
        except Exception as exc:
            results = [exc] * len(run)
        for job, result in zip(run, results, strict=True):
            out[id(job)] = result

    def finish(self, batch: Round) -> list[tuple[Job, dict[str, Any] | BaseException]]:
        done: list[tuple[Job, dict[str, Any] | BaseException]] = []
        again: list[Job] = []
        for _name, jobs in batch.batches.items():
            stalled = bool(jobs) and all(batch.outcomes.get(id(j)) is WAIT for j in jobs)
            for job in jobs:
                outcome = batch.outcomes.get(id(job))
                if isinstance(outcome, dict | BaseException):
                    done.append((job, outcome))
                elif stalled:
                    self._parked.append(job)
                else:
                    again.append(job)
        self._queue.extendleft(reversed(again))
        return done

    def run_round(self) -> list[tuple[Job, dict[str, Any] | BaseException]]:
        batch = self.take()
        self.forward(batch)
        return self.finish(batch)
