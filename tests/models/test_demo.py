"""The demo model end to end: streaming audio equals batch decoding, concurrency changes nothing."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from mstar_async.models import build_model
from mstar_async.models.demo import DemoConfig, TinyCodec, TinyLM, _seeded, tokenize
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.policies import SlidingWindowChunkPolicy
from mstar_async.runtime import open_runtime

pytestmark = pytest.mark.anyio
CFG = DemoConfig()


async def run_one(runtime: Any, **inputs: Any) -> list[Any]:
    async with runtime.generate(**inputs) as outputs:
        return [item async for item in outputs]


def reference_pcm(text: str, max_codes: int) -> torch.Tensor:
    """Greedy codes from the LM run directly, decoded with the same sliding windows."""
    lm = _seeded(CFG.seed, lambda: TinyLM(CFG))
    codec = _seeded(CFG.seed + 1, lambda: TinyCodec(CFG))
    assert isinstance(lm, TinyLM) and isinstance(codec, TinyCodec)
    with torch.inference_mode():
        state = lm.prefill([tokenize(text, CFG)])
        codes = []
        h, code = state["h"], state["code"]
        for _ in range(max_codes):
            step = lm.step(code, h)
            h, code = step["h"], step["code"]
            codes.append(int(code))
            if int(code) == CFG.end_of_speech:
                break
        policy = SlidingWindowChunkPolicy(CFG.window, CFG.stride)
        chunks = policy.push(torch.tensor(codes)) + policy.close()
        return torch.cat(codec.forward(chunks)["pcm"])


async def test_demo_streams_audio_then_an_image() -> None:
    with anyio.fail_after(60):
        async with open_runtime(build_model("demo")) as runtime:
            items = await run_one(runtime, text="streaming", max_codes=30)
    audio = [i for i in items if isinstance(i, AudioChunk)]
    images = [i for i in items if isinstance(i, ImageOutput)]
    assert isinstance(items[-1], ImageOutput) and len(images) == 1
    assert images[0].image.shape == (3, CFG.image_size, CFG.image_size)
    assert 0.0 <= float(images[0].image.min()) and float(images[0].image.max()) <= 1.0
    # The first chunk is one full window; each later one is one stride of new codes.
    assert audio[0].pcm.numel() == CFG.window * CFG.hop
    assert all(a.pcm.numel() == CFG.stride * CFG.hop for a in audio[1:-1])
    assert sum(a.pcm.numel() for a in audio) == 30 * CFG.hop


async def test_streamed_pcm_equals_decoding_all_codes_with_the_same_windows() -> None:
    with anyio.fail_after(60):
        async with open_runtime(build_model("demo")) as runtime:
            items = await run_one(runtime, text="compare me", max_codes=27)
    streamed = torch.cat([i.pcm for i in items if isinstance(i, AudioChunk)])
    expected = reference_pcm("compare me", 27)
    assert streamed.shape == expected.shape
    torch.testing.assert_close(streamed, expected, atol=1e-6, rtol=0)


async def test_concurrent_requests_match_requests_run_alone() -> None:
    prompts = [("alpha", 12), ("beta gamma", 20), ("delta", 33), ("epsilon zeta eta", 7)] * 2
    with anyio.fail_after(120):
        async with open_runtime(build_model("demo")) as runtime:
            alone = [
                await run_one(runtime, text=p, max_codes=n, seed=i)
                for i, (p, n) in enumerate(prompts)
            ]
            together: dict[int, list[Any]] = {}

            async def one(i: int) -> None:
                text, n = prompts[i]
                together[i] = await run_one(runtime, text=text, max_codes=n, seed=i)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert runtime.batching.stats.max_batch > 1
    for i, expected in enumerate(alone):
        got = together[i]
        assert [type(x) for x in got] == [type(x) for x in expected]
        for a, b in zip(got, expected, strict=True):
            x, y = (a.pcm, b.pcm) if isinstance(a, AudioChunk) else (a.image, b.image)
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
