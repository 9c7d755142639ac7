"""``mstar bench image``: end-to-end latency of the bagel model by how its CFG branches run.

Three modes of the same model, same seeded weights, in one process:

- ``forked``: the prompt is prefilled once into the paged KV cache; the three guidance
  branches are forks of it, and each denoising step runs one batched ``attend`` forward of the
  image's latent tokens over every branch's cached context;
- ``dense``: dense concatenation, the usual CFG implementation: every step batches the three
  branches, each with its whole context (prompt, and the input image's ViT tokens when editing)
  followed by the latent tokens, and recomputes all of it;
- ``sequential``: forked KV, but the branches run one after another.

Two tasks: text-to-image (a prompt of ``prompt_tokens`` tokens) and editing (an input image of
``vit`` tokens, then an instruction of ``edit_tokens`` tokens). At each concurrency N, N requests
start together and each one's end-to-end latency is recorded; the report gives p50 per mode and
the p50 ratios against ``forked``, and the KV blocks the forked modes held at their peak.

Noise control: all three runtimes are open at once and warmed up at every concurrency; each
repetition runs the modes one at a time in alternating order, and ratios are taken within a
repetition. torch runs ``threads`` intra-op threads (1 by default: on a shared 2-core machine a
competing process slows multi-threaded torch by up to 10x). Each measurement records how many
cores other processes kept busy meanwhile (``foreign_cores``), so a disturbed figure shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, replace
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
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.loop import run_async
from mstar_async.models.bagel import CFG_MODES, bagel_config, build_bagel
from mstar_async.runtime import RuntimeSettings, open_runtime

Progress = Callable[[str], None]
TASKS = ("t2i", "edit")
#: The aim: forked-KV CFG's p50 latency at least this many times lower than dense concatenation.
AIM = 1.3


@dataclass(frozen=True)
class ImageConfig:
    """What ``mstar bench image`` measures."""

    size: str = "small"
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    steps: int = 8
    repeat: int = 3
    prompt_tokens: int = 64
    edit_tokens: int = 32
    threads: int = 1
    modes: tuple[str, ...] = CFG_MODES
    tasks: tuple[str, ...] = TASKS


def preset(quick: bool) -> ImageConfig:
    """The full workload (N = 1, 2, 4, 8, 8 steps, 3 repetitions), or ``quick``: N = 1, 2,
    3 steps, one repetition (well under a minute)."""
    if quick:
        return ImageConfig(concurrency=(1, 2), steps=3, repeat=1)
    return ImageConfig()


def configure(base: ImageConfig, **changes: Any) -> ImageConfig:
    """``base`` with every change that is not None applied."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def _text(tokens: int) -> str:
    # One byte is one token (plus the begin-of-sequence id): BAGEL's prompts of a few dozen
    # Qwen2 tokens are the same number of positions here.
    words = "a photo of a red fox sitting in tall grass at golden hour, soft light, detailed "
    return (words * (tokens // len(words) + 1))[: tokens - 1]


def _request(config: ImageConfig, task: str, index: int) -> dict[str, Any]:
    request: dict[str, Any] = {"steps": config.steps, "seed": index}
    if task == "t2i":
        return {**request, "prompt": _text(config.prompt_tokens)}
    size = bagel_config(config.size).vit_image_size
    image = torch.rand(3, size, size, generator=torch.Generator().manual_seed(index))
    return {**request, "prompt": _text(config.edit_tokens), "image": image}


async def _one(runtime: Any, request: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with runtime.generate(**request) as outputs:
        async for _ in outputs:
            pass
    return time.perf_counter() - started


async def _round(runtime: Any, config: ImageConfig, task: str, n: int) -> list[float]:
    latencies: list[float] = []

    async def one(k: int) -> None:
        latencies.append(await _one(runtime, _request(config, task, k)))

    async with anyio.create_task_group() as tg:
        for k in range(n):
            tg.start_soon(one, k)
    return latencies


async def run_image(config: ImageConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Measure every mode, task and concurrency of ``config``; return the report (the shape of
    ``mstar_async.bench.report``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    machine = machine_info()
    try:
        measured = await _run(config, progress)
    finally:
        torch.set_num_threads(threads)
    machine["load_average_end"] = machine_info()["load_average"]
    return _report(config, measured, machine, time.perf_counter() - started)


@dataclass
class _Measured:
    """Per (task, mode, N): latencies, KV peaks and foreign cores; per (task, N): the rounds
    of p50s, one per repetition, that ratios are taken within."""

    latencies: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    peaks: dict[tuple[str, str, int], int] = field(default_factory=dict)
    rounds: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)
    foreign: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)


async def _run(config: ImageConfig, progress: Progress) -> _Measured:
    measured = _Measured()
    async with AsyncExitStack() as stack:
        runtimes = {}
        for mode in config.modes:
            model = build_bagel(config.size, cfg=mode)
            runtimes[mode] = await stack.enter_async_context(
                open_runtime(model, settings=RuntimeSettings(max_batch_tokens=1 << 16))
            )
        for task in config.tasks:
            for n in config.concurrency:
                for mode in config.modes:
                    await _round(runtimes[mode], replace(config, steps=1), task, n)
        progress("warmed up")
        for rep in range(config.repeat):
            for task in config.tasks:
                for n in config.concurrency:
                    p50s = await _repetition(runtimes, config, (task, n, rep), measured, progress)
                    measured.rounds.setdefault((task, n), []).append(p50s)
    return measured


async def _repetition(
    runtimes: dict[str, Any],
    config: ImageConfig,
    where: tuple[str, int, int],
    measured: _Measured,
    progress: Progress,
) -> dict[str, float]:
    """Every mode's round of ``where``'s (task, N, repetition), order alternating by
    repetition; their p50s."""
    task, n, rep = where
    p50s: dict[str, float] = {}
    for mode in config.modes if rep % 2 == 0 else config.modes[::-1]:
        p50s[mode] = await _measure(runtimes[mode], config, (task, mode, n), measured)
        progress(f"rep {rep} {task} N={n} {mode}: p50 {p50s[mode]:.3f} s")
    return p50s


async def _measure(
    runtime: Any, config: ImageConfig, key: tuple[str, str, int], measured: _Measured
) -> float:
    """One round of ``key``'s (task, mode, N) requests, recorded into ``measured``; its p50."""
    task, _, n = key
    engine = runtime.batching.engines.get("lm")
    if not isinstance(engine, KVCacheEngine):
        engine = None
    if engine is not None:
        engine.reset_peak()
    before = cpu_sample()
    values = await _round(runtime, config, task, n)
    others = foreign_cores(before, cpu_sample())
    if others is not None:
        measured.foreign.setdefault(key, []).append(round(others, 2))
    measured.latencies.setdefault(key, []).extend(values)
    if engine is not None:
        measured.peaks[key] = max(measured.peaks.get(key, 0), engine.peak_blocks_in_use)
    return percentile(values, 50)


#: What each mode runs, for the report's ``systems``.
_DESCRIPTIONS = {
    "forked": "the prompt prefilled once; the CFG branches are forks of its paged KV, one "
    "batched attend forward per step",
    "dense": "dense concatenation: every step batches the branches, each recomputing its whole "
    "context",
    "sequential": "forked KV, the branches one after another",
}


def _rows(config: ImageConfig, measured: _Measured) -> list[dict[str, Any]]:
    """One row per (task, N): every mode's p50 latency and KV peak, and the p50 ratios."""
    pairs = [(m, "forked") for m in config.modes if m != "forked"]
    rows: list[dict[str, Any]] = []
    for (task, n), rounds in measured.rounds.items():
        systems: dict[str, Any] = {}
        for mode in config.modes:
            key = (task, mode, n)
            values = measured.latencies[key]
            entry: dict[str, Any] = {
                "p50_s": round(percentile(values, 50), 4),
                "requests": len(values),
            }
            if key in measured.peaks:
                entry["kv_peak_blocks"] = measured.peaks[key]
            if key in measured.foreign:
                entry["foreign_cores"] = measured.foreign[key]
            systems[mode] = entry
        table = ratio_table(rounds, pairs) if "forked" in config.modes else {}
        ratios = {k: v.to_json() for k, v in table.items()}
        rows.append({"task": task, "concurrency": n, "systems": systems, "ratios": ratios})
    return rows


def _aims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        aim_entry(
            f"{row['task']} N={row['concurrency']}: forked p50 >= {AIM:g}x lower than dense",
            AIM,
            row["ratios"]["dense/forked"]["median"],
            task=row["task"],
            concurrency=row["concurrency"],
            ratio="dense/forked",
        )
        for row in rows
        if "dense/forked" in row["ratios"]
    ]


def _report(
    config: ImageConfig, measured: _Measured, machine: dict[str, Any], seconds: float
) -> dict[str, Any]:
    cfg = bagel_config(config.size)
    rows = _rows(config, measured)
    workload = {
        "model": "bagel",
        **asdict(config),
        "shape": {
            "image_tokens": cfg.image_tokens,
            "vit_tokens": cfg.vit_grid**2,
            "hidden": cfg.hidden,
            "layers": cfg.layers,
            "block_size": 16,
        },
    }
    return make_report(
        "image",
        workload=workload,
        machine=machine,
        systems=[system_entry(mode, _DESCRIPTIONS[mode]) for mode in config.modes],
        results=rows,
        aims=_aims(rows),
        seconds=seconds,
    )


def run_image_sync(config: ImageConfig, progress: Progress = quiet) -> dict[str, Any]:
    """``run_image`` on a fresh event loop (uvloop where installed)."""
    report: dict[str, Any] = run_async(run_image, config, progress)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: p50 latency per task, concurrency and mode, and the ratios."""
    work = report["workload"]
    modes = [entry["name"] for entry in report["systems"]]
    lines = [
        f"bagel {work['size']}, {work['steps']} steps, {work['repeat']} repetition(s), "
        f"torch threads {work['threads']}; image tokens {work['shape']['image_tokens']}",
        f"{'task':5} {'N':>3} "
        + " ".join(f"{m + ' p50 s':>16}" for m in modes)
        + "  dense/forked  sequential/forked  kv blocks (forked)",
    ]
    for row in report["results"]:
        systems, ratio = row["systems"], row["ratios"]
        cells = " ".join(f"{systems[m]['p50_s']:16.3f}" for m in modes)
        dense = ratio.get("dense/forked", {}).get("median", float("nan"))
        seq = ratio.get("sequential/forked", {}).get("median", float("nan"))
        blocks = systems.get("forked", {}).get("kv_peak_blocks", "-")
        lines.append(
            f"{row['task']:5} {row['concurrency']:>3} {cells}  {dense:12.2f}  {seq:17.2f}  {blocks}"
        )
    for entry in report["aims"]:
        lines.append(
            f"aim {entry['name']}: {entry['measured']:.2f}x: "
            + ("met" if entry["met"] else "NOT met")
        )
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> None:
    """Draw p50 latency against concurrency, one panel per task, one line per mode, to a PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'mstar-async[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    modes = [entry["name"] for entry in report["systems"]]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        mine = sorted((r for r in rows if r["task"] == task), key=lambda r: r["concurrency"])
        ns = [r["concurrency"] for r in mine]
        for mode in modes:
            ax.plot(ns, [r["systems"][mode]["p50_s"] for r in mine], marker="o", label=mode)
        ax.set_title(f"bagel {report['workload']['size']}: {task}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("p50 end-to-end latency (s)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
