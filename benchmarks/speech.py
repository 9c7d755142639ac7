"""Orpheus speech: time to first audio and real-time factor at a few concurrent requests.

``python -m benchmarks.speech --size small --requests 4 --max-tokens 141 --threads 1``: builds
``orpheus`` at ``size``, warms it up with one request, then runs ``requests`` requests at once
(seeds 10, 11, ...), each stopping at ``<end_of_speech>`` or ``max_tokens``. Per request it
reports TTFA (submit to first audio chunk) and RTF (end-to-end seconds / audio seconds), and
overall the audio seconds produced per wall second. ``--threads`` sets torch's intra-op
threads; on a shared 2-core machine 1 thread avoids oversubscription stalls.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import torch

from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import open_runtime


async def _one(runtime: Any, seed: int, max_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    first: float | None = None
    samples, rate = 0, 24_000
    async with runtime.generate(
        text="Hello there, how are you?", seed=seed, max_tokens=max_tokens
    ) as out:
        async for item in out:
            if isinstance(item, AudioChunk):
                first = time.perf_counter() - started if first is None else first
                samples, rate = samples + item.pcm.numel(), item.sample_rate
    total = time.perf_counter() - started
    audio = samples / rate
    return {"ttfa_s": first or 0.0, "total_s": total, "audio_s": audio, "rtf": total / audio}


async def run(size: str, requests: int, max_tokens: int) -> dict[str, Any]:
    """Measure ``requests`` concurrent requests on ``orpheus`` at ``size``."""
    async with open_runtime(build_model("orpheus", size=size)) as runtime:
        await _one(runtime, 0, max_tokens)
        results: list[dict[str, float]] = []

        async def task(seed: int) -> None:
            results.append(await _one(runtime, seed, max_tokens))

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(requests):
                tg.start_soon(task, 10 + i)
        wall = time.perf_counter() - started
    audio = sum(r["audio_s"] for r in results)
    return {"size": size, "requests": results, "wall_s": wall, "audio_per_wall_s": audio / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=141)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(anyio.run(run, args.size, args.requests, args.max_tokens), indent=1))


if __name__ == "__main__":
    main()
