"""Helpers every benchmark shares: statistics, ratio tables, machine facts and progress.

The statistics are deliberately small and exact (no numpy): a benchmark reports medians with
their spread over a few repetitions, and tests check these helpers against hand-computed values.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = [
    "CpuSample",
    "ProgressLog",
    "Summary",
    "child_pids",
    "cpu_model",
    "cpu_sample",
    "foreign_cores",
    "free_port",
    "machine_info",
    "percentile",
    "process_cpu_seconds",
    "quiet",
    "ratio_table",
    "summarize",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating linearly between ranks.

    Same definition as numpy's default ("linear"): rank ``q / 100 * (n - 1)`` of the sorted
    values, so the 50th percentile of an even count is the mean of the two middle values.

    Raises:
        ValueError: ``values`` is empty, or ``q`` is not in [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(float(v) for v in values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Summary:
    """Median, minimum and maximum of ``n`` repeated measurements."""

    median: float
    min: float
    max: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        """The summary as a JSON-ready dict (floats rounded to 4 decimals)."""
        return {
            "median": round(self.median, 4),
            "min": round(self.min, 4),
            "max": round(self.max, 4),
            "n": self.n,
        }


def summarize(values: Sequence[float]) -> Summary:
    """Median, min and max of ``values``.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("summary of no values")
    return Summary(percentile(values, 50), float(min(values)), float(max(values)), len(values))


def ratio_table(
    rounds: Sequence[Mapping[str, float]], pairs: Sequence[tuple[str, str]]
) -> dict[str, Summary]:
    """Summaries of ``numerator / denominator`` per pair, one ratio per round.

    Each round maps a system to the value it measured in that round; the ratio is taken within
    a round (measurements made back to back share the machine's state at that moment) and only
    then summarised, rather than dividing the medians of values taken minutes apart. Keys of
    the result are ``"numerator/denominator"``.

    Raises:
        ValueError: no rounds, a round lacks a system of a pair, or a denominator is not > 0.
    """
    if not rounds:
        raise ValueError("ratio table of no rounds")
    table: dict[str, Summary] = {}
    for numerator, denominator in pairs:
        ratios: list[float] = []
        for index, measured in enumerate(rounds):
            if numerator not in measured or denominator not in measured:
                raise ValueError(
                    f"round {index} lacks {numerator!r} or {denominator!r}: {sorted(measured)}"
                )
            if not measured[denominator] > 0:
                raise ValueError(
                    f"round {index}: {denominator!r} measured {measured[denominator]!r}, not > 0"
                )
            ratios.append(measured[numerator] / measured[denominator])
        table[f"{numerator}/{denominator}"] = summarize(ratios)
    return table


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _load_average() -> list[float] | None:
    # A busy shared machine shows here; recorded so a reader can judge the noise.
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    """Facts about this machine and software that figures depend on (JSON-ready)."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average": _load_average(),
    }
    try:
        import transformers

        info["transformers_version"] = transformers.__version__
    except ImportError:
        info["transformers_version"] = None
    return info


@dataclass(frozen=True, slots=True)
class CpuSample:
    """A reading of the clocks :func:`foreign_cores` compares: wall time, CPU time all CPUs
    spent busy (``None`` where the system does not say), and CPU time of this process."""

    wall: float
    busy: float | None
    own: float


def _busy_seconds() -> float | None:
    # /proc/stat's first line sums every CPU: user nice system idle iowait irq softirq steal
    # (guest time is already inside user). Steal counts as busy: a neighbour VM took the CPU.
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
        ticks = [int(x) for x in fields[1:9]]
        busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) that process ``pid`` has used so far, from /proc.

    Raises:
        OSError: the process does not exist or /proc is not there (not Linux).
    """
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # The command name (field 2) may hold spaces; the fields after its ")" are fixed.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int | None = None) -> list[int]:
    """The ids of the direct child processes of ``pid`` (this process), from /proc; an empty
    list where /proc does not say (not Linux)."""
    pid = os.getpid() if pid is None else pid
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as listing:
                children.extend(int(child) for child in listing.read().split())
    except (OSError, ValueError):
        return children
    return children


def cpu_sample(children: Sequence[int] = ()) -> CpuSample:
    """Read the clocks now (Linux gives ``busy``; elsewhere it is ``None``).

    ``children`` are ids of processes whose CPU time counts as this process's own (worker or
    stage processes of the system being measured); one that cannot be read counts as 0.
    """
    times = os.times()
    own = times.user + times.system
    for pid in children:
        try:
            own += process_cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            pass
    return CpuSample(time.perf_counter(), _busy_seconds(), own)


def foreign_cores(start: CpuSample, end: CpuSample) -> float | None:
    """How many cores, on average between two samples, something other than this process kept
    busy (other processes, the kernel, a neighbour VM); ``None`` when unknown.

    On a shared machine this says whether a measurement competed for the CPUs: it is the busy
    time of all CPUs minus this process's own CPU time, over the wall time between the samples.
    """
    if start.busy is None or end.busy is None or end.wall <= start.wall:
        return None
    others = (end.busy - start.busy) - (end.own - start.own)
    return max(0.0, others / (end.wall - start.wall))


class ProgressLog:
    """Prints progress lines, stamped with seconds since creation, to ``stream`` (stderr).

    Benchmarks report progress through a plain ``Callable[[str], None]``; this is the one the
    CLI passes, so stdout stays free for the results (``--json`` prints only JSON there).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        """Print ``message`` with the elapsed time, and flush so it shows at once."""
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:7.1f}s] {message}", file=self.stream, flush=True)


def quiet(message: str) -> None:
    """A progress callback that prints nothing."""
