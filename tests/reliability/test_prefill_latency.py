"""A long but valid prompt prefilling beside a running request: the running request's
inter-token latency stays within 3x its unloaded p99 (SmolLM2 on the CPU, in process).

The aim compares latency distributions: the p99 of the gaps while the prompt prefills (chunks
sized to keep a forward beside the decodes near a decode round and a half) against the p99 of
100 gaps before it. The worst single gap is printed beside it, not held to 3x: one forward's own
time varies up to 2x on these VMs (the same 2-token chunk beside a decode took 33 or 63 ms), so
the largest of hundreds of gaps against the largest of 100 measures that variance more than the
scheduler. Measured here: p99 1.44-2.14x quiet, 1.27x and 1.58x beside a process spinning on
one of the two cores (whose unloaded p99 grows tenfold, the ratio stays); worst gap 1.3-4.4x.
Without chunked prefill the prompt's one forward would take some 100 decode rounds (it prefills
in 2.5 s alone, a decode round takes 18-25 ms).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from mstar_async.bench.common import percentile
from mstar_async.engines import Step, StepResult
from mstar_async.models import build_model
from mstar_async.outputs import TextDelta
from mstar_async.runtime import open_runtime

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,  # a latency measurement over many rounds
    pytest.mark.timeout(300),
    # What is measured is the scheduler's chunking, not the event loop: one loop (the one
    # servers run on) keeps the suite's time.
    pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})], ids=["uvloop"]),
]

#: About 800 tokens of SmolLM2: beside a decode a prompt chunk of the int4 model costs ~2.7 ms
#: a token here, so this takes seconds to prefill.
LONG_PROMPT = "The history of the city is long and full of turns. " * 66
UNLOADED = 100  # inter-token gaps measured before the long prompt arrives


async def test_a_long_prompt_keeps_a_running_requests_itl_near_its_unloaded_p99() -> None:
    async with open_runtime(build_model("causal-lm")) as runtime:
        await _collect(runtime, "warm up", 4)
        # From the long prompt's first forward: its tokenization runs on the event loop
        # before that (one gap of the running request pays it; moving it off the loop is
        # separate work).
        engine = _FirstForward(runtime.batching.engines["lm"])
        runtime.batching.engines["lm"] = engine
        stamps: list[float] = []
        window: dict[str, float] = {}

        async def running() -> None:
            async with runtime.generate(prompt="Count", max_tokens=2000, ignore_eos=True) as out:
                async for item in out:
                    if isinstance(item, TextDelta):
                        stamps.append(time.perf_counter())
                    if "prefilled" in window and len(stamps) > window["count"] + 3:
                        break

        async def long_prompt() -> None:
            while len(stamps) < UNLOADED + 2:  # noqa: ASYNC110  (counts the other task's tokens)
                await anyio.sleep(0.01)
            async with runtime.generate(prompt=LONG_PROMPT, max_tokens=1) as out:
                engine.watch = out.request_id
                async for _ in out:
                    break
            window["start"] = engine.first
            window["prefilled"] = time.perf_counter()
            window["count"] = len(stamps)

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                tg.start_soon(running)
                tg.start_soon(long_prompt)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    unloaded = gaps[1:UNLOADED]
    during = [
        b - a
        for a, b in itertools.pairwise(stamps)
        if a >= window["start"] and b <= window["prefilled"]
    ]
    assert window["prefilled"] - window["start"] > 3 * max(unloaded)  # a long prefill indeed
    assert len(during) >= 50, f"only {len(during)} tokens of the running request in the prefill"
    p99 = percentile(unloaded, 99)
    during_p99 = percentile(during, 99) / p99
    worst = max(during) / p99
    typical = percentile(during, 50) / percentile(unloaded, 50)
    print(
        f"unloaded p99 {p99 * 1000:.1f} ms; during the prefill ({len(during)} gaps) p99 "
        f"{during_p99:.2f}x, worst gap {worst:.2f}x; median gap {typical:.2f}x the unloaded median"
    )
    assert during_p99 <= 3 and typical <= 3.5


class _FirstForward:
    """Wraps the engine: when the first forward holding ``watch``'s steps started."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.watch: str | None = None
        self.first = float("inf")

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        started = time.perf_counter()
        if any(step.request_id == self.watch for step in steps):
            self.first = min(self.first, started)
        return self.inner.forward(steps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _collect(runtime: object, prompt: str, tokens: int) -> None:
    async with runtime.generate(prompt=prompt, max_tokens=tokens) as out:  # type: ignore[attr-defined]
        async for _ in out:
            pass
