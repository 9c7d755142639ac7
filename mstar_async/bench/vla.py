"""Action-chunk latency of the ``pi05`` policy: concurrent requests through the runtime against
the same requests one after another.

Workload: the ``pi05`` model (``small`` by default: a 224 x 224 image through EfficientNet-Lite0,
a 6-layer prefix LM of width 256, a 6-layer action expert of width 128, chunks of 50 x 32, 10
flow steps), requests with instructions of different lengths and their own seeded image and
state. For each concurrency N:

- ``concurrent``: N requests submitted at once to one runtime; the vision encoder, the prefix
  LM and every flow step batch across them (the policy engine pads prefixes of different
  lengths). Latency is each request's submit-to-``ActionOutput`` time; throughput is N chunks
  over the wall time from the first submit to the last chunk.
- ``sequential``: the same N requests one after another on the same runtime: each request's
  latency alone, and N chunks over their summed time.

The ratio is concurrent throughput over sequential throughput, taken within a repetition and
then summarised. Every repetition records how many cores other processes kept busy meanwhile
(``foreign_cores``): on a shared 2-core machine that is the main source of noise.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import torch

from mstar_async.bench.common import (
    cpu_sample,
    foreign_cores,
    machine_info,
    percentile,
    quiet,
    ratio_table,
    summarize,
)
from mstar_async.bench.report import make_report, system_entry
from mstar_async.engines.prefix_cache import PrefixCacheEngine
from mstar_async.loop import run_async
from mstar_async.models import build_model
from mstar_async.models.pi05.model import PolicyCache
from mstar_async.outputs import ActionOutput
from mstar_async.runtime import Runtime, open_runtime

Progress = Callable[[str], None]

INSTRUCTIONS = (
    "pick up the cup",
    "open the top drawer and put the red block inside it",
    "wipe the table",
    "fold the towel in half, then place it on the left side of the table next to the bowl",
    "press the green button",
    "stack the blue cube on top of the yellow cube",
)


@dataclass(frozen=True)
class VlaConfig:
    """What to measure. ``quick`` uses the ``tiny`` model and one repetition.

    Raises:
        ValueError: a count is below 1.
    """

    size: str = "small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    steps: int = 10
    repeat: int = 3
    #: torch intra-op threads while measuring. On a small shared machine two OpenMP threads
    #: stall in barriers whenever a neighbour takes a core (a tiny request went from 0.3 s to
    #: 2-4 s at load 10 on 2 cores), so the default measures the runtime, not the neighbours.
    threads: int = 1

    def __post_init__(self) -> None:
        counts = (self.steps, self.repeat, self.threads, *self.concurrency)
        if not self.concurrency or min(counts) < 1:
            raise ValueError(f"steps, repeat and every concurrency must be >= 1: {self}")


def preset(quick: bool) -> VlaConfig:
    """The full workload, or the quick one (tiny model, one repetition; well under a minute)."""
    return VlaConfig(size="tiny", repeat=1) if quick else VlaConfig()


def request_inputs(index: int, steps: int) -> dict[str, Any]:
    """The inputs of request ``index``: a rotating instruction and its own seed."""
    return {"instruction": INSTRUCTIONS[index % len(INSTRUCTIONS)], "seed": index, "steps": steps}


async def _one(runtime: Runtime, inputs: dict[str, Any], shape: tuple[int, int]) -> float:
    started = time.perf_counter()
    async with runtime.generate(**inputs) as outputs:
        items = [item async for item in outputs]
    if len(items) != 1 or not isinstance(items[0], ActionOutput):
        raise RuntimeError(f"pi05 gave {items!r} instead of one ActionOutput")
    if tuple(items[0].actions.shape) != shape:
        raise RuntimeError(f"action chunk {tuple(items[0].actions.shape)}, expected {shape}")
    return time.perf_counter() - started


async def run_concurrent(
    runtime: Runtime, requests: Sequence[dict[str, Any]], shape: tuple[int, int]
) -> tuple[list[float], float]:
    """Latencies of ``requests`` submitted at once, and the wall time until the last finished."""
    latencies: list[float] = []

    async def one(inputs: dict[str, Any]) -> None:
        latencies.append(await _one(runtime, inputs, shape))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for inputs in requests:
            tg.start_soon(one, inputs)
    return latencies, time.perf_counter() - started


async def run_sequential(
    runtime: Runtime, requests: Sequence[dict[str, Any]], shape: tuple[int, int]
) -> tuple[list[float], float]:
    """Latencies of ``requests`` run one after another, and their total time."""
    latencies = [await _one(runtime, inputs, shape) for inputs in requests]
    return latencies, sum(latencies)


def _figures(latencies: Sequence[float], wall: float, foreign: float | None) -> dict[str, Any]:
    return {
        "p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "p95_ms": round(percentile(latencies, 95) * 1000, 2),
        "chunks_per_s": round(len(latencies) / wall, 3),
        "seconds": round(wall, 4),
        "foreign_cores": None if foreign is None else round(foreign, 3),
    }


async def _measure(
    mode: str, runtime: Runtime, requests: Sequence[dict[str, Any]], shape: tuple[int, int]
) -> dict[str, Any]:
    gc.collect()
    before = cpu_sample()
    run = run_concurrent if mode == "concurrent" else run_sequential
    latencies, wall = await run(runtime, requests, shape)
    return _figures(latencies, wall, foreign_cores(before, cpu_sample()))


def _summarise(n: int, reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    entry: dict[str, Any] = {"concurrency": n, "repetitions": reps}
    for mode in ("concurrent", "sequential"):
        entry[mode] = {
            key: summarize([r[mode][key] for r in reps]).to_json()
            for key in ("p50_ms", "p95_ms", "chunks_per_s")
        }
    rounds = [{m: r[m]["chunks_per_s"] for m in ("concurrent", "sequential")} for r in reps]
    ratio = ratio_table(rounds, [("concurrent", "sequential")])["concurrent/sequential"]
    entry["throughput_ratio"] = ratio.to_json()
    return entry


async def run_vla(config: VlaConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Measure ``config``; the report (the shape of ``mstar_async.bench.report``), one row
    per concurrency, and no aim.

    Raises:
        RuntimeError: a request did not give one action chunk of the model's shape.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return await _run(config, progress)
    finally:
        torch.set_num_threads(threads)


async def _run(config: VlaConfig, progress: Progress) -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info()
    model = build_model("pi05", size=config.size)
    results: list[dict[str, Any]] = []
    progress(f"opening the runtime for pi05 ({config.size})")
    async with open_runtime(model) as runtime:
        engine = runtime.batching.engines["policy"]
        assert isinstance(engine, PrefixCacheEngine) and isinstance(engine.model, PolicyCache)
        cfg = engine.model.policy.cfg
        shape = (cfg.action_horizon, cfg.action_dim)
        for n in sorted(set(config.concurrency)):
            requests = [request_inputs(i, config.steps) for i in range(n)]
            # Warm-up: the first forwards of each batch shape pay for allocation.
            await run_concurrent(runtime, requests, shape)
            reps: list[dict[str, dict[str, Any]]] = []
            for rep in range(config.repeat):
                order = (
                    ("concurrent", "sequential") if rep % 2 == 0 else ("sequential", "concurrent")
                )
                measured = {mode: await _measure(mode, runtime, requests, shape) for mode in order}
                reps.append(measured)
                progress(
                    f"N={n} repetition {rep + 1}/{config.repeat}: concurrent "
                    f"{measured['concurrent']['chunks_per_s']:.2f} chunks/s, p50 "
                    f"{measured['concurrent']['p50_ms']:.0f} ms; sequential "
                    f"{measured['sequential']['chunks_per_s']:.2f} chunks/s, p50 "
                    f"{measured['sequential']['p50_ms']:.0f} ms"
                )
            results.append(_summarise(n, reps))
        largest = max(engine.suffix_batches, default=0)
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "vla",
        workload={
            "model": "pi05",
            **asdict(config),
            "concurrency": list(config.concurrency),
            "action_chunk": list(shape),
            "image_size": cfg.image_size,
            "largest_flow_step_batch": largest,
        },
        machine=machine,
        systems=[
            system_entry(
                "concurrent",
                "N requests submitted at once to one runtime; vision, prefix and flow steps "
                "batch across them",
            ),
            system_entry("sequential", "the same N requests one after another, same runtime"),
        ],
        results=results,
        # No target is set for this benchmark, so it judges no aim.
        aims=[],
        seconds=time.perf_counter() - started,
    )


def run_vla_sync(config: VlaConfig, progress: Progress = quiet) -> dict[str, Any]:
    """``run_vla`` on a fresh event loop (uvloop where installed)."""
    report: dict[str, Any] = run_async(run_vla, config, progress)
    return report


def format_vla(report: dict[str, Any]) -> str:
    """The report as a table: per N, latency p50/p95 and chunks/s for both modes, and the ratio."""
    work, machine = report["workload"], report["machine"]
    chunk = "x".join(map(str, work["action_chunk"]))
    lines = [
        f"vla benchmark: pi05 {work['size']}, {chunk} chunks, {work['steps']} flow steps, "
        f"{work['repeat']} repetition(s), {work['threads']} torch thread(s)",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch "
        f"{machine['torch_version']}, load average {machine['load_average']} -> "
        f"{machine.get('load_average_end')}",
        "each cell: median over repetitions; ratio = concurrent / sequential chunks/s",
        "",
    ]
    header = (
        f"{'N':>3} | {'conc p50 ms':>11} | {'conc p95 ms':>11} | {'conc chunks/s':>13} | "
        f"{'seq p50 ms':>10} | {'seq p95 ms':>10} | {'seq chunks/s':>12} | {'ratio':>6}"
    )
    lines += [header, "-" * len(header)]
    for r in report["results"]:
        c, s = r["concurrent"], r["sequential"]
        lines.append(
            f"{r['concurrency']:>3} | {c['p50_ms']['median']:>11.1f} | "
            f"{c['p95_ms']['median']:>11.1f} | {c['chunks_per_s']['median']:>13.2f} | "
            f"{s['p50_ms']['median']:>10.1f} | {s['p95_ms']['median']:>10.1f} | "
            f"{s['chunks_per_s']['median']:>12.2f} | {r['throughput_ratio']['median']:>5.2f}x"
        )
    lines.append(f"largest batch of flow steps in one forward: {work['largest_flow_step_batch']}")
    return "\n".join(lines)


def plot_vla(reports: Sequence[dict[str, Any]], path: str) -> bool:
    """Draw chunks/s against N, concurrent and sequential, one panel per report, into ``path``
    (a PNG). Returns False, drawing nothing, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 3.6), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        ns = [r["concurrency"] for r in report["results"]]
        for mode, style in (("concurrent", "o-"), ("sequential", "s--")):
            cells = [r[mode]["chunks_per_s"] for r in report["results"]]
            low = [c["median"] - c["min"] for c in cells]
            high = [c["max"] - c["median"] for c in cells]
            ax.errorbar(ns, [c["median"] for c in cells], yerr=[low, high], fmt=style, label=mode)
        work = report["workload"]
        ax.set_title(f"pi05 {work['size']} ({'x'.join(map(str, work['action_chunk']))} chunks)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel("action chunks / s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
