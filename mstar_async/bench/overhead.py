"""Control-plane overhead: what the runtime itself costs per request per loop iteration.

Workload: the ``noop`` model (``mstar_async.models.noop``): one walk, a ``DynamicLoop`` over
one node whose engine does no work (it adds one to a counter carried from iteration to
iteration). N requests run at once, K iterations each; every iteration's output is yielded by
the request program and read by the client here (N tasks, each iterating
``runtime.generate(iterations=K)``), and the counter is checked. Two engines:

- ``no-work``: the forward returns at once. Wall time / (N * K) is the control plane's cost
  per request-iteration: walk interpretation, the batching loop, the transport to a worker,
  the program and the request stream.
- ``fixed-cost``: each batched forward sleeps ``forward_ms`` (2 ms; ``time.sleep`` releases
  the GIL) once, whatever its batch size, as a forward of a real model would take time. Its
  overhead per request-iteration is (wall time - forwards * one forward's time) / (N * K),
  where one forward's time is a 2 ms ``time.sleep`` as measured in the same run (it
  overshoots by tens of microseconds here); with two workers the forwards of the busier worker
  are subtracted (the two sleep at the same time).

Systems: ``in-process`` (``open_runtime(model)``), ``one-worker`` (``Placement.single()``: the
engine in one worker process) and ``two-workers`` (the ``count`` node replicated on ranks 0
and 1, so requests split between two worker processes).

Forwards are counted in the engine: every output carries the id of the process that ran it
and that engine's forward number, so the forwards of a measurement are the rise of the
highest forward number seen per process (in process this is checked against the batching
loop's own count, within one: a run's last forward may hold only the steps launched ahead of
loops that then stopped, which no output stamps, so the next run's stamps count it). Rounds
per second are forwards over wall time (summed over workers).

Noise control: every system is warmed up at every N first; then per N the systems run in
turn, their order reversed every repetition, with a garbage collection before each
measurement. Each measurement records how many cores other processes kept busy meanwhile
(``foreign_cores``; the machine may be shared), but nothing is measured again.

The result is a report of the shape every benchmark has (``mstar_async.bench.report``)::

    {
      "benchmark": "overhead",
      "workload": {"mode", "engines", "forward_ms", "concurrency", "iterations", "repeat",
                   "warmup_iterations", "loop", "notes"},
      "machine": machine_info() of mstar_async.bench.common, plus "load_average_end",
      "systems": [{"name", "placement", "worker_processes", "description"}, ...],
      "results": [{"engine", "forward_ms", "system", "concurrency", "iterations", "steps",
                   "us_per_request_iteration": S, "overhead_us_per_request_iteration": S,
                   "rounds_per_s": S, "forwards": S, "mean_batch": S, "seconds": S,
                   "foreign_cores": S | None, "steps_by_process": [int, ...],
                   "samples": [{"seconds", "forwards", "foreign_cores"}, ...]}, ...],
      "aims": [{"name", "target", "measured", "met", "compare": "<=", "engine", "system",
                "concurrency", "metric"}, ...],
      "seconds": float,
    }

where ``S`` is a ``Summary.to_json()`` over the repetitions. ``steps`` is N * K (checked: the
client counted exactly that many outputs). An aim whose row was not measured has ``measured``
and ``met`` ``None``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from mstar_async.bench.common import (
    CpuSample,
    ProgressLog,
    cpu_sample,
    foreign_cores,
    machine_info,
    quiet,
    summarize,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.errors import MstarError
from mstar_async.loop import run_async
from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime

__all__ = [
    "AIMS",
    "ENGINES",
    "SYSTEMS",
    "Aim",
    "BenchmarkError",
    "OverheadConfig",
    "configure",
    "format_report",
    "preset",
    "run_overhead",
    "run_overhead_sync",
]

Progress = Callable[[str], None]

#: The systems, by the names the result uses, in the order of the first repetition.
SYSTEMS = ("in-process", "one-worker", "two-workers")

#: The engines: ``no-work`` and ``fixed-cost`` (sleeps ``forward_ms`` per forward).
ENGINES = ("no-work", "fixed-cost")

_DESCRIPTIONS = {
    "in-process": "open_runtime(model): engine and batching loop in this process",
    "one-worker": "Placement.single(): the engine in one worker process (IPC)",
    "two-workers": "the count node on ranks [0, 1]: requests split over two worker processes",
}


class BenchmarkError(MstarError):
    """The benchmark cannot produce honest figures: a configuration is invalid, or a system
    returned the wrong outputs or a forward count that does not add up."""


@dataclass(frozen=True, slots=True)
class Aim:
    """A target: ``metric`` of ``engine`` on ``system`` at N=``concurrency`` <= ``target``."""

    engine: str
    system: str
    concurrency: int
    metric: str
    target: float

    def describe(self) -> str:
        """The aim in words, e.g. ``no-work, in-process, N=128: ... <= 10 us``."""
        what = "overhead" if self.metric.startswith("overhead") else "wall time"
        return (
            f"{self.engine}, {self.system}, N={self.concurrency}: {what} per "
            f"request-iteration <= {self.target:g} us"
        )


#: What the issue asks of the control plane (microseconds per request-iteration).
AIMS = (
    Aim("no-work", "in-process", 128, "us_per_request_iteration", 10.0),
    Aim("no-work", "one-worker", 128, "us_per_request_iteration", 15.0),
    Aim("no-work", "in-process", 1, "us_per_request_iteration", 150.0),
    Aim("no-work", "one-worker", 1, "us_per_request_iteration", 200.0),
    Aim("fixed-cost", "in-process", 32, "overhead_us_per_request_iteration", 10.0),
    Aim("fixed-cost", "one-worker", 32, "overhead_us_per_request_iteration", 10.0),
)


@dataclass(frozen=True)
class OverheadConfig:
    """What to measure.

    Attributes:
        systems: which of ``SYSTEMS`` to run.
        engines: which of ``ENGINES`` to run.
        concurrency: the numbers N of concurrent requests.
        iterations: loop iterations K per request.
        repeat: repetitions of every (engine, system, N) measurement.
        warmup_iterations: iterations per request of the warm-up run at every N.
        forward_ms: the fixed-cost engine's sleep per forward, in milliseconds.
        mode: a label for the report (``quick`` or ``default``).
    """

    systems: tuple[str, ...] = SYSTEMS
    engines: tuple[str, ...] = ENGINES
    concurrency: tuple[int, ...] = (1, 32, 128)
    iterations: int = 200
    repeat: int = 3
    warmup_iterations: int = 10
    forward_ms: float = 2.0
    mode: str = "default"

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            BenchmarkError: a field is out of range or names an unknown system or engine.
        """
        for name, known in (("systems", SYSTEMS), ("engines", ENGINES)):
            chosen = getattr(self, name)
            if not chosen or any(c not in known for c in chosen):
                raise BenchmarkError(f"{name} must be among {list(known)}, got {list(chosen)}")
        if not self.concurrency or any(n < 1 for n in self.concurrency):
            raise BenchmarkError(f"concurrency must be ints >= 1, got {self.concurrency}")
        for name in ("iterations", "repeat", "warmup_iterations"):
            if getattr(self, name) < 1:
                raise BenchmarkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.forward_ms > 0:
            raise BenchmarkError(f"forward_ms must be > 0, got {self.forward_ms}")


def preset(quick: bool) -> OverheadConfig:
    """The default workload (N = 1, 32, 128; K = 200; 3 repetitions), or with ``quick``
    N = 1, 32, K = 50 and 2 repetitions (about half a minute on two busy cores)."""
    if quick:
        return OverheadConfig(
            concurrency=(1, 32), iterations=50, repeat=2, warmup_iterations=5, mode="quick"
        )
    return OverheadConfig()


def configure(base: OverheadConfig, **overrides: Any) -> OverheadConfig:
    """``base`` with the ``overrides`` that are not None (command-line options left unset).

    Raises:
        BenchmarkError: the result breaks a rule of ``OverheadConfig``.
    """
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


# --------------------------------------------------------------------------- systems


def _placement(system: str) -> Placement | None:
    if system == "in-process":
        return None
    if system == "one-worker":
        return Placement.single()
    return Placement(nodes={"count": [0, 1]})


def _forward_ms(engine: str, config: OverheadConfig) -> float:
    return config.forward_ms if engine == "fixed-cost" else 0.0


@dataclass
class _Tally:
    """What the client saw of one measurement: outputs per process and the highest forward
    number per process."""

    steps: dict[int, int] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)


@dataclass
class _System:
    """An open runtime of one system and what its engines had done before the next run."""

    name: str
    runtime: Runtime
    forwards_seen: dict[int, int] = field(default_factory=dict)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids (none in process), for CPU accounting."""
        pool = self.runtime.pool
        if pool is None:
            return []
        pids = (pool.pid(rank) for rank in pool.ranks)
        return [pid for pid in pids if pid is not None]


@asynccontextmanager
async def _open_systems(
    engine: str, config: OverheadConfig, progress: Progress
) -> AsyncIterator[dict[str, _System]]:
    """Every configured system of ``engine``, open together until the block exits.

    Raises:
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    async with AsyncExitStack() as stack:
        systems: dict[str, _System] = {}
        for name in config.systems:
            started = time.perf_counter()
            model = build_model("noop", forward_ms=_forward_ms(engine, config))
            runtime = await stack.enter_async_context(
                open_runtime(model, placement=_placement(name))
            )
            systems[name] = _System(name, runtime)
            progress(f"{engine}: {name} open in {time.perf_counter() - started:.2f} s")
        yield systems


# --------------------------------------------------------------------------- measuring


async def _request(runtime: Runtime, iterations: int, tally: _Tally) -> None:
    """One request: read every iteration's output, check its counter, note its stamp.

    Raises:
        BenchmarkError: an output's counter is not the iteration's, or too few came.
    """
    expected = 0
    steps, last = tally.steps, tally.last
    async with runtime.generate(iterations=iterations) as outputs:
        async for n, pid, forward in outputs:
            expected += 1
            if n != expected:
                raise BenchmarkError(f"iteration {expected} returned counter {n}")
            steps[pid] = steps.get(pid, 0) + 1
            if forward > last.get(pid, 0):
                last[pid] = forward
    if expected != iterations:
        raise BenchmarkError(f"a request made {expected} outputs, expected {iterations}")


@dataclass(frozen=True, slots=True)
class _Sample:
    seconds: float
    steps: dict[int, int]
    forwards: dict[int, int]  # per process
    foreign_cores: float | None

    @property
    def total_forwards(self) -> int:
        return sum(self.forwards.values())


async def _measure(system: _System, n: int, iterations: int) -> _Sample:
    """Run ``n`` requests of ``iterations`` at once on ``system``; time them and count.

    Raises:
        BenchmarkError: wrong outputs, or forwards that disagree with the batching loop's.
    """
    tally = _Tally()
    batching = system.runtime.batching if system.runtime.pool is None else None
    loop_before = None if batching is None else batching.stats.forwards
    gc.collect()
    children = system.worker_pids()
    before: CpuSample = cpu_sample(children)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(_request, system.runtime, iterations, tally)
    seconds = time.perf_counter() - started
    foreign = foreign_cores(before, cpu_sample(children))
    forwards = {pid: last - system.forwards_seen.get(pid, 0) for pid, last in tally.last.items()}
    system.forwards_seen.update(tally.last)
    if batching is not None and loop_before is not None:
        # The last forward of a run may carry only steps launched ahead of loops that then
        # stopped (dropped, so no output stamps it): the stamps see it in the next run.
        counted = batching.stats.forwards - loop_before
        if abs(counted - sum(forwards.values())) > 1:
            raise BenchmarkError(f"engine stamps say {forwards} forwards, the loop {counted}")
    if sum(tally.steps.values()) != n * iterations:
        raise BenchmarkError(f"{sum(tally.steps.values())} outputs, expected {n * iterations}")
    return _Sample(seconds, dict(tally.steps), forwards, foreign)


def _sleep_seconds(forward_ms: float, tries: int = 50) -> float:
    """What one fixed-cost forward's ``time.sleep`` really takes on this machine now (the
    median of ``tries``): a sleep overshoots by tens of microseconds, which is the kernel's and
    not the runtime's, so the overhead subtracts the measured sleep, not the nominal one."""
    if forward_ms <= 0:
        return 0.0
    taken = []
    for _ in range(tries):
        start = time.perf_counter()
        time.sleep(forward_ms / 1e3)
        taken.append(time.perf_counter() - start)
    return summarize(taken).median


def _row(
    engine: str,
    forward_ms: float,
    system: str,
    n: int,
    k: int,
    samples: Sequence[_Sample],
    forward_s: float,
) -> dict[str, Any]:
    """One result entry: the samples' figures summarised over the repetitions; ``forward_s``
    is one forward's measured time (see ``_sleep_seconds``)."""
    steps = n * k

    def stat(values: Sequence[float]) -> dict[str, float | int]:
        return summarize(values).to_json()

    sleeping = [forward_s * max(s.forwards.values(), default=0) for s in samples]
    foreign = [s.foreign_cores for s in samples if s.foreign_cores is not None]
    return {
        "engine": engine,
        "forward_ms": forward_ms,
        "forward_ms_measured": round(forward_s * 1e3, 4),
        "system": system,
        "concurrency": n,
        "iterations": k,
        "steps": steps,
        "us_per_request_iteration": stat([s.seconds / steps * 1e6 for s in samples]),
        "overhead_us_per_request_iteration": stat(
            [(s.seconds - slept) / steps * 1e6 for s, slept in zip(samples, sleeping, strict=True)]
        ),
        "rounds_per_s": stat([s.total_forwards / s.seconds for s in samples]),
        "forwards": stat([s.total_forwards for s in samples]),
        "mean_batch": stat([steps / max(1, s.total_forwards) for s in samples]),
        "seconds": stat([s.seconds for s in samples]),
        "foreign_cores": stat(foreign) if foreign else None,
        "steps_by_process": sorted(samples[-1].steps.values(), reverse=True),
        "samples": [
            {
                "seconds": round(s.seconds, 6),
                "forwards": s.total_forwards,
                "foreign_cores": None if s.foreign_cores is None else round(s.foreign_cores, 3),
            }
            for s in samples
        ],
    }


async def _run_engine(
    engine: str, config: OverheadConfig, progress: Progress
) -> list[dict[str, Any]]:
    """Every (system, N) row of ``engine``: warm-up, then interleaved repetitions."""
    rows: list[dict[str, Any]] = []
    async with _open_systems(engine, config, progress) as systems:
        for name, system in systems.items():
            progress(f"{engine}: warming up {name}")
            for n in config.concurrency:
                await _measure(system, n, config.warmup_iterations)
        for n in config.concurrency:
            samples: dict[str, list[_Sample]] = {name: [] for name in systems}
            for rep in range(config.repeat):
                order = list(systems) if rep % 2 == 0 else list(reversed(systems))
                for name in order:
                    sample = await _measure(systems[name], n, config.iterations)
                    samples[name].append(sample)
                    _report(progress, engine, name, n, rep, config, sample)
            forward_ms = _forward_ms(engine, config)
            forward_s = await anyio.to_thread.run_sync(_sleep_seconds, forward_ms)
            for name in systems:
                row = _row(engine, forward_ms, name, n, config.iterations, samples[name], forward_s)
                rows.append(row)
        progress(f"{engine}: closing the runtimes")
    return rows


def _report(
    progress: Progress,
    engine: str,
    system: str,
    n: int,
    rep: int,
    config: OverheadConfig,
    sample: _Sample,
) -> None:
    us = sample.seconds / (n * config.iterations) * 1e6
    others = "" if sample.foreign_cores is None else f", other processes {sample.foreign_cores:.2f}"
    progress(
        f"{engine} N={n} repetition {rep + 1}/{config.repeat}: {system} {us:.1f} us per "
        f"request-iteration, {sample.total_forwards} forwards in {sample.seconds:.3f} s{others}"
    )


# --------------------------------------------------------------------------- aims and run


def _aims(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    found = {(r["engine"], r["system"], r["concurrency"]): r for r in results}
    aims: list[dict[str, Any]] = []
    for goal in AIMS:
        row = found.get((goal.engine, goal.system, goal.concurrency))
        aims.append(
            aim_entry(
                goal.describe(),
                goal.target,
                None if row is None else row[goal.metric]["median"],
                compare="<=",
                engine=goal.engine,
                system=goal.system,
                concurrency=goal.concurrency,
                metric=goal.metric,
            )
        )
    return aims


def _loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    import asyncio

    return "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"


def _systems(config: OverheadConfig) -> list[dict[str, Any]]:
    entries = []
    for name in config.systems:
        placement = _placement(name)
        entries.append(
            system_entry(
                name,
                _DESCRIPTIONS[name],
                placement=None if placement is None else placement.to_dict(),
                worker_processes=0 if placement is None else placement.ranks,
            )
        )
    return entries


_NOTES = [
    "us per request-iteration: wall time from the first request's start to the last "
    "request's end, over N * K",
    "overhead: wall time minus the engine's sleep (forwards * forward_ms; with two workers the "
    "busier worker's forwards), over N * K; for no-work it equals the wall time figure",
    "rounds per second: engine forwards (summed over workers) per wall second",
    "forwards are counted from each output's (pid, forward number) stamp",
]


async def run_overhead(config: OverheadConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Run the overhead benchmark on the running event loop; see the module doc for the
    result's shape.

    Raises:
        BenchmarkError: a system returned wrong outputs or a forward count that does not add up.
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    started = time.perf_counter()
    machine = machine_info()
    progress(
        f"overhead benchmark ({config.mode} mode): N={list(config.concurrency)}, "
        f"K={config.iterations}, {config.repeat} repetition(s), load average "
        f"{machine['load_average']}"
    )
    results: list[dict[str, Any]] = []
    for engine in config.engines:
        results.extend(await _run_engine(engine, config, progress))
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "overhead",
        workload={
            "mode": config.mode,
            "model": "noop",
            "engines": list(config.engines),
            "forward_ms": config.forward_ms,
            "concurrency": list(config.concurrency),
            "iterations": config.iterations,
            "repeat": config.repeat,
            "warmup_iterations": config.warmup_iterations,
            "loop": _loop_name(),
            "notes": list(_NOTES),
        },
        machine=machine,
        systems=_systems(config),
        results=results,
        aims=_aims(results),
        seconds=time.perf_counter() - started,
    )


def run_overhead_sync(config: OverheadConfig, progress: Progress | None = None) -> dict[str, Any]:
    """``run_overhead`` on a fresh event loop (uvloop when installed); progress on stderr by
    default.

    Raises:
        As ``run_overhead``.
    """
    log: Progress = progress if progress is not None else ProgressLog()
    report: dict[str, Any] = run_async(run_overhead, config, log)
    return report


# --------------------------------------------------------------------------- text report


def _cell(summary: dict[str, Any] | None, digits: int = 1) -> str:
    if summary is None:
        return "-"
    median, low, high = summary["median"], summary["min"], summary["max"]
    if summary["n"] == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def format_report(report: dict[str, Any]) -> str:
    """The report as text: one table per engine, then the aims."""
    work, machine = report["workload"], report["machine"]
    lines = [
        f"overhead benchmark ({work['mode']} mode, {work['loop']} loop): noop model, "
        f"K={work['iterations']} iterations per request, {work['repeat']} repetition(s)",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, load average "
        f"{machine['load_average']} -> {machine.get('load_average_end')}",
        "each cell: median [min-max] over repetitions; us = microseconds per request-iteration",
    ]
    header = (
        f"{'system':>11} | {'N':>4} | {'us/req-iter':>22} | {'overhead us':>22} | "
        f"{'rounds/s':>24} | {'batch':>6} | {'others':>6}"
    )
    for engine in work["engines"]:
        sleep = f" ({work['forward_ms']:g} ms per forward)" if engine == "fixed-cost" else ""
        lines += ["", f"{engine} engine{sleep}", header, "-" * len(header)]
        for r in report["results"]:
            if r["engine"] != engine:
                continue
            others = "-" if r["foreign_cores"] is None else f"{r['foreign_cores']['max']:.2f}"
            lines.append(
                f"{r['system']:>11} | {r['concurrency']:>4} | "
                f"{_cell(r['us_per_request_iteration']):>22} | "
                f"{_cell(r['overhead_us_per_request_iteration']):>22} | "
                f"{_cell(r['rounds_per_s'], 0):>24} | {r['mean_batch']['median']:>6.1f} | "
                f"{others:>6}"
            )
    lines += [
        "",
        "batch: mean steps per forward; others: the most cores other processes kept busy",
        "",
        "aims:",
    ]
    for entry in report["aims"]:
        if entry["met"] is None:
            verdict = "not measured in this run"
        else:
            verdict = f"{entry['measured']:.1f} us: {'met' if entry['met'] else 'NOT met'}"
        lines.append(f"  {entry['name']}: {verdict}")
    lines.append(f"\ntotal {report['seconds']} s")
    return "\n".join(lines)
