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
from dataclasses import asdict, dataclass, replace
from typing import Any

import anyio
import torch

from benchmarks.common import (
    cpu_sample,
    foreign_cores,
    machine_info,
    percentile,
    quiet,
    ratio_table,
)
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.models.bagel import CFG_MODES, bagel_config, build_bagel
from mstar_async.runtime import open_runtime

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
    """Measure every mode, task and concurrency of ``config``; return the JSON-ready report."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return await _run(config, progress)
    finally:
        torch.set_num_threads(threads)


async def _run(config: ImageConfig, progress: Progress) -> dict[str, Any]:
    latencies: dict[tuple[str, str, int], list[float]] = {}
    peaks: dict[tuple[str, str, int], int] = {}
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {}
    foreign: dict[tuple[str, str, int], list[float]] = {}
    async with AsyncExitStack() as stack:
        runtimes = {}
        for mode in config.modes:
            model = build_bagel(config.size, cfg=mode)
            runtimes[mode] = await stack.enter_async_context(
                open_runtime(model, max_batch_tokens=1 << 16)
            )
        for task in config.tasks:
            for n in config.concurrency:
                for mode in config.modes:
                    await _round(runtimes[mode], replace(config, steps=1), task, n)
        progress("warmed up")
        for rep in range(config.repeat):
            for task in config.tasks:
                for n in config.concurrency:
                    order = config.modes if rep % 2 == 0 else config.modes[::-1]
                    measured: dict[str, float] = {}
                    for mode in order:
                        engine = runtimes[mode].batching.engines.get("lm")
                        if not isinstance(engine, KVCacheEngine):
                            engine = None
                        if engine is not None:
                            engine.reset_peak()
                        before = cpu_sample()
                        values = await _round(runtimes[mode], config, task, n)
                        others = foreign_cores(before, cpu_sample())
                        if others is not None:
                            foreign.setdefault((task, mode, n), []).append(round(others, 2))
                        latencies.setdefault((task, mode, n), []).extend(values)
                        measured[mode] = percentile(values, 50)
                        if engine is not None:
                            key = (task, mode, n)
                            peaks[key] = max(peaks.get(key, 0), engine.peak_blocks_in_use)
                        progress(f"rep {rep} {task} N={n} {mode}: p50 {measured[mode]:.3f} s")
                    rounds.setdefault((task, n), []).append(measured)
    return _report(config, latencies, peaks, rounds, foreign)


def _report(
    config: ImageConfig,
    latencies: dict[tuple[str, str, int], list[float]],
    peaks: dict[tuple[str, str, int], int],
    rounds: dict[tuple[str, int], list[dict[str, float]]],
    foreign: dict[tuple[str, str, int], list[float]],
) -> dict[str, Any]:
    cfg = bagel_config(config.size)
    results: dict[str, Any] = {}
    for (task, mode, n), values in latencies.items():
        entry: dict[str, Any] = {"p50_s": round(percentile(values, 50), 4), "requests": len(values)}
        if (task, mode, n) in peaks:
            entry["kv_peak_blocks"] = peaks[(task, mode, n)]
        if (task, mode, n) in foreign:
            entry["foreign_cores"] = foreign[(task, mode, n)]
        results.setdefault(task, {}).setdefault(mode, {})[str(n)] = entry
    pairs = [(m, "forked") for m in config.modes if m != "forked"]
    ratios: dict[str, Any] = {}
    for (task, n), measured in rounds.items():
        table = ratio_table(measured, pairs) if "forked" in config.modes else {}
        ratios.setdefault(task, {})[str(n)] = {k: v.to_json() for k, v in table.items()}
    aims = {
        task: {
            n: ratios[task][n]["dense/forked"]["median"] >= AIM
            for n in ratios[task]
            if "dense/forked" in ratios[task][n]
        }
        for task in ratios
    }
    return {
        "benchmark": "image",
        "config": asdict(config),
        "shape": {
            "image_tokens": cfg.image_tokens,
            "vit_tokens": cfg.vit_grid**2,
            "hidden": cfg.hidden,
            "layers": cfg.layers,
            "block_size": 16,
        },
        "machine": machine_info(),
        "results": results,
        "ratios": ratios,
        "aim": {"dense/forked >=": AIM, "met": aims},
    }


def run_image_sync(config: ImageConfig, progress: Progress = quiet) -> dict[str, Any]:
    """``run_image`` on a fresh event loop."""

    async def main() -> dict[str, Any]:
        return await run_image(config, progress)

    return anyio.run(main)


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: p50 latency per task, concurrency and mode, and the ratios."""
    config = report["config"]
    lines = [
        f"bagel {config['size']}, {config['steps']} steps, {config['repeat']} repetition(s), "
        f"torch threads {config['threads']}; image tokens {report['shape']['image_tokens']}",
        f"{'task':5} {'N':>3} "
        + " ".join(f"{m + ' p50 s':>16}" for m in config["modes"])
        + "  dense/forked  sequential/forked  kv blocks (forked)",
    ]
    for task, modes in report["results"].items():
        for n in modes[config["modes"][0]]:
            cells = " ".join(f"{modes[m][n]['p50_s']:16.3f}" for m in config["modes"])
            ratio = report["ratios"][task][n]
            dense = ratio.get("dense/forked", {}).get("median", float("nan"))
            seq = ratio.get("sequential/forked", {}).get("median", float("nan"))
            blocks = modes.get("forked", {}).get(n, {}).get("kv_peak_blocks", "-")
            lines.append(f"{task:5} {n:>3} {cells}  {dense:12.2f}  {seq:17.2f}  {blocks}")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> None:
    """Draw p50 latency against concurrency, one panel per task, one line per mode, to a PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'mstar-async[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(report["results"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for mode, by_n in report["results"][task].items():
            ns = sorted(by_n, key=int)
            ax.plot([int(n) for n in ns], [by_n[n]["p50_s"] for n in ns], marker="o", label=mode)
        ax.set_title(f"bagel {report['config']['size']}: {task}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("p50 end-to-end latency (s)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
