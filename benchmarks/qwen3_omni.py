"""qwen3-omni request timings: time to first text and audio, total time and real-time factor.

``python -m benchmarks.qwen3_omni --size tiny --max-tokens 64 --repeats 3 [--concurrency N]``
runs greedy text with seeded sampled speech (``ignore_eos`` so every run makes the same number
of tokens) in one process and prints one JSON line: medians (min, max) of each figure over the
repeats, plus the machine facts. RTF is wall time over seconds of audio produced (< 1 is faster
than real time); with concurrency it is per request.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from benchmarks.common import machine_info, summarize
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, TextDelta
from mstar_async.runtime import open_runtime

PROMPT = "Tell me about the sea and the ships that sail on it."


async def _one(runtime: Any, max_tokens: int, seed: int) -> dict[str, float]:
    start = time.perf_counter()
    first_text = first_audio = None
    audio = 0.0
    async with runtime.generate(
        text=PROMPT, max_tokens=max_tokens, ignore_eos=True, seed=seed
    ) as outputs:
        async for item in outputs:
            now = time.perf_counter() - start
            if isinstance(item, TextDelta) and first_text is None:
                first_text = now
            if isinstance(item, AudioChunk):
                first_audio = now if first_audio is None else first_audio
                audio += item.seconds
    total = time.perf_counter() - start
    return {
        "ttft_s": first_text or total,
        "ttfa_s": first_audio or total,
        "total_s": total,
        "audio_s": audio,
        "rtf": total / audio if audio else float("inf"),
    }


async def run(size: str, max_tokens: int, repeats: int, concurrency: int) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result."""
    model = build_model("qwen3-omni", size=size)
    runs: list[dict[str, float]] = []
    async with open_runtime(model) as runtime:
        await _one(runtime, 4, 0)  # warm up: engines built, first kernels run
        for rep in range(repeats):
            results: list[dict[str, float]] = []

            async def request(i: int, rep: int = rep, results: list[Any] = results) -> None:
                results.append(await _one(runtime, max_tokens, seed=rep * concurrency + i))

            async with anyio.create_task_group() as tg:
                for i in range(concurrency):
                    tg.start_soon(request, i)
            runs.extend(results)
    figures = {}
    for key in runs[0]:
        s = summarize([r[key] for r in runs])
        figures[key] = [round(s.median, 4), round(s.min, 4), round(s.max, 4)]
    return {
        "size": size,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "requests": len(runs),
        "figures_median_min_max": figures,
        "machine": machine_info(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run, print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = anyio.run(run, args.size, args.max_tokens, args.repeats, args.concurrency)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
