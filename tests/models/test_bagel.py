"""bagel through the runtime: forked-KV CFG against dense and sequential CFG, KV block counts,
release on finish and cancel, guidance scales, the editing walk."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.errors import RequestError
from mstar_async.models.bagel import bagel_config, build_bagel, tokenize
from mstar_async.models.bagel.flow import MAX_STEPS
from mstar_async.models.bagel.model import load_image
from mstar_async.outputs import ImageOutput
from mstar_async.runtime import open_runtime

PROMPT = "a red circle on a blue square"
EDIT_IMAGE = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(7))
#: float32 throughout; the paths differ only in summation order (paged gather vs padded dense).
TOLERANCE = 1e-4


async def _images(mode: str, requests: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Run the requests concurrently on one runtime of ``mode``; their images, in order."""
    images: list[torch.Tensor | None] = [None] * len(requests)
    async with open_runtime(build_bagel("tiny", cfg=mode)) as runtime:

        async def one(k: int) -> None:
            async with runtime.generate(**requests[k]) as outputs:
                async for item in outputs:
                    assert isinstance(item, ImageOutput)
                    images[k] = item.image

        async with anyio.create_task_group() as tg:
            for k in range(len(requests)):
                tg.start_soon(one, k)
        if mode != "dense":
            engine = runtime.batching.engines["lm"]
            assert engine.blocks_in_use == 0
            assert len(engine.allocator) == 0
    assert all(image is not None for image in images)
    return [image for image in images if image is not None]


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_forked_kv_cfg_matches_dense_and_sequential_cfg() -> None:
    requests = [
        {"prompt": PROMPT, "steps": 3},
        {"prompt": "make it green", "image": EDIT_IMAGE, "steps": 3, "cfg_img_scale": 1.5},
    ]
    forked = await _images("forked", requests)
    dense = await _images("dense", requests)
    sequential = await _images("sequential", requests)
    for f, d, s in zip(forked, dense, sequential, strict=True):
        assert f.shape == (3, 64, 64)
        assert (f - d).abs().max() < TOLERANCE
        assert (f - s).abs().max() < TOLERANCE
    # The input image conditions the edit: it is not the text-to-image result.
    assert (forked[0] - forked[1]).abs().max() > 1e-2


def _branch_blocks(context: int, queries: int, block: int) -> int:
    """Blocks one attend forward takes for a branch: a private copy of a partly filled last
    block (shared with the prefix), plus room for the latent tokens."""
    partial = context % block
    return -(-(partial + queries) // block)


class _Recorder:
    """Wraps an engine's forward to record peak blocks per op and to signal the first attend."""

    def __init__(self, engine: KVCacheEngine) -> None:
        self.engine = engine
        self.attending = threading.Event()
        self.prefix_blocks = -1
        forward = engine.forward

        def recording(steps: Any) -> Any:
            if any(s.op == "attend" for s in steps) and self.prefix_blocks < 0:
                self.prefix_blocks = engine.blocks_in_use
                engine.reset_peak()
                self.attending.set()
            return forward(steps)

        engine.forward = recording  # type: ignore[method-assign]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_kv_blocks_are_one_prefix_plus_branch_tokens_and_all_come_back() -> None:
    cfg = bagel_config("tiny")
    n, bs = cfg.image_tokens, 16
    async with open_runtime(build_bagel("tiny")) as runtime:
        engine = runtime.batching.engines["lm"]
        recorder = _Recorder(engine)
        async with runtime.generate(prompt=PROMPT, steps=2) as outputs:
            async for _ in outputs:
                pass
        prompt = len(tokenize(PROMPT))  # 30 tokens: two blocks, the second partly filled
        assert recorder.prefix_blocks == -(-prompt // bs) == 2
        # cond and img_uncond fork the prompt, text_uncond is empty: each branch adds only
        # its latent tokens (and a copy of the shared partial block), never a second prefix.
        expected = 2 + 2 * _branch_blocks(prompt, n, bs) + _branch_blocks(0, n, bs)
        assert engine.peak_blocks_in_use == expected == 2 + 2 * 2 + 1
        assert engine.peak_blocks_in_use < 3 * 2 + 3 * -(-n // bs)  # vs one prefix per branch
        assert engine.blocks_in_use == 0
        assert len(engine.allocator) == 0

        # Editing: cond = ViT tokens + instruction, text_uncond = a fork at the ViT tokens,
        # img_uncond = the instruction alone (its own sequence: its positions differ).
        recorder = _Recorder(engine)
        async with runtime.generate(prompt="make it green", image=EDIT_IMAGE, steps=2) as outputs:
            async for _ in outputs:
                pass
        vit, text = cfg.vit_grid**2, len(tokenize("make it green"))  # 16 and 14 tokens
        held = -(-(vit + text) // bs) + -(-text // bs)
        assert recorder.prefix_blocks == held == 3
        scratch = (
            _branch_blocks(vit + text, n, bs)
            + _branch_blocks(vit, n, bs)
            + _branch_blocks(text, n, bs)
        )
        assert engine.peak_blocks_in_use == held + scratch == 3 + 2 + 1 + 2
        assert engine.blocks_in_use == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cancel_during_generation_returns_every_block() -> None:
    async with open_runtime(build_bagel("tiny")) as runtime:
        engine = runtime.batching.engines["lm"]
        recorder = _Recorder(engine)
        outputs = runtime.generate(prompt="make it green", image=EDIT_IMAGE, steps=50)
        async with outputs:
            await anyio.to_thread.run_sync(recorder.attending.wait, 30.0)
            assert engine.blocks_in_use > 0
        # Closing early cancelled the request; its engines have released it.
        assert engine.blocks_in_use == 0
        assert len(engine.allocator) == 0
        engine.allocator.check_invariants()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_guidance_scales_change_the_image() -> None:
    base = {"prompt": PROMPT, "steps": 2}
    images = await _images(
        "forked",
        [
            {**base, "cfg_text_scale": 1.0},
            {**base, "cfg_text_scale": 4.0},
            {**base, "cfg_text_scale": 4.0, "seed": 1},
            {**base, "image": EDIT_IMAGE, "cfg_img_scale": 1.0},
            {**base, "image": EDIT_IMAGE, "cfg_img_scale": 2.0},
        ],
    )
    for a, b in [(0, 1), (1, 2), (3, 4)]:
        assert (images[a] - images[b]).abs().max() > 1e-3, (a, b)


def test_an_image_tensor_of_another_size_is_resized_and_a_bad_one_named() -> None:
    cfg = bagel_config("tiny")
    small = torch.rand(3, 32, 48)
    resized = load_image(small, cfg)
    assert resized.shape == (3, 64, 64) and 0 <= resized.min() <= resized.max() <= 1
    assert torch.equal(load_image(EDIT_IMAGE, cfg), EDIT_IMAGE)
    with pytest.raises(ValueError, match=r"image must be \[3, height, width\]"):
        load_image(torch.rand(64, 64), cfg)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_schedule_past_max_steps_is_refused_before_it_runs() -> None:
    async with open_runtime(build_bagel("tiny")) as runtime:
        with pytest.raises(RequestError) as refused:
            async with runtime.generate(prompt="x", steps=MAX_STEPS + 1) as outputs:
                [item async for item in outputs]
        assert isinstance(refused.value.__cause__, ValueError)
        assert runtime.batching.stats.forwards == 0
