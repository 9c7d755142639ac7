"""vjepa2 end to end: the KV-cached rollout through the runtime equals the reference rollout
that re-runs the predictor over the whole context every step (fp32, within 1e-4)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import torch

from mstar_async.errors import RequestError
from mstar_async.models import build_model
from mstar_async.models.vjepa2 import RolloutInputs, make_config, random_inputs, recompute_rollout
from mstar_async.models.vjepa2.engines import seeded
from mstar_async.outputs import LatentOutput
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CFG = make_config("tiny")
TOLERANCE = 1e-4  # fp32; the cached and recomputed paths differ in summation order only


def reference(inputs: RolloutInputs) -> list[torch.Tensor]:
    encoder, predictor = seeded(CFG)
    return recompute_rollout(encoder, predictor, inputs)


def as_kwargs(inputs: RolloutInputs) -> dict[str, Any]:
    return {
        "video": inputs.video,
        "actions": inputs.actions,
        "context_actions": inputs.context_actions,
        "states": inputs.states,
        "horizon": inputs.horizon,
    }


async def rollout(runtime: Any, **inputs: Any) -> list[LatentOutput]:
    async with runtime.generate(**inputs) as outputs:
        items = [item async for item in outputs]
    assert all(isinstance(item, LatentOutput) for item in items)
    return items


def assert_matches(items: list[LatentOutput], expected: list[torch.Tensor]) -> None:
    assert [item.step for item in items] == list(range(len(expected)))
    for item, want in zip(items, expected, strict=True):
        assert item.latent.shape == (CFG.patches_per_frame, CFG.encoder_dim)
        torch.testing.assert_close(item.latent, want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("horizon", [1, 2, 5, 12])
async def test_cached_rollout_equals_recomputing_the_context(horizon: int) -> None:
    inputs = random_inputs(CFG, horizon, seed=horizon)
    async with open_runtime(build_model("vjepa2")) as runtime:
        items = await rollout(runtime, **as_kwargs(inputs))
    assert_matches(items, reference(inputs))


async def test_default_inputs_are_seeded_and_predictions_change_with_the_plan() -> None:
    async with open_runtime(build_model("vjepa2")) as runtime:
        first = await rollout(runtime, horizon=4, seed=7)
        again = await rollout(runtime, horizon=4, seed=7)
        other = await rollout(runtime, horizon=4, seed=8)
    assert_matches(first, reference(random_inputs(CFG, 4, seed=7)))
    for a, b, c in zip(first, again, other, strict=True):
        # The same seed, the same predictions: to the numerics' tolerance, since chunks are
        # sized from measured forward times and may split a context differently each run.
        torch.testing.assert_close(a.latent, b.latent, atol=TOLERANCE, rtol=0)
        assert not torch.allclose(a.latent, c.latent, atol=1e-3)


async def test_concurrent_requests_with_different_horizons_and_contexts_batch_and_match() -> None:
    # Context lengths 1..3 and horizons 2..9: prefills of several frames share forwards with
    # one-frame steps of other requests, so the padded, masked attention path runs.
    cases = [
        random_inputs(CFG, horizon, seed=10 + i, context_frames=frames)
        for i, (horizon, frames) in enumerate([(2, 1), (9, 3), (5, 2), (7, 1), (3, 3)])
    ]
    results: dict[int, list[LatentOutput]] = {}
    async with open_runtime(build_model("vjepa2")) as runtime:

        async def one(i: int) -> None:
            results[i] = await rollout(runtime, **as_kwargs(cases[i]))

        async with anyio.create_task_group() as tg:
            for i in range(len(cases)):
                tg.start_soon(one, i)
        assert runtime.batching.stats.max_batch > 1
        assert runtime.batching.engines["predictor"].frames_in_use == 0
    for i, inputs in enumerate(cases):
        assert_matches(results[i], reference(inputs))


async def test_kv_frames_are_freed_after_finish_and_after_cancel() -> None:
    async with open_runtime(build_model("vjepa2")) as runtime:
        engine = runtime.batching.engines["predictor"]
        await rollout(runtime, horizon=3)
        assert engine.frames_in_use == 0
        async with runtime.generate(horizon=40) as outputs:
            async for item in outputs:
                if item.step == 2:
                    # context frames plus the two predicted frames fed back so far
                    assert engine.frames_in_use >= CFG.context_frames + 1
                    break
        assert engine.frames_in_use == 0
        assert engine.allocator.num_free_blocks == CFG.kv_frames


async def test_a_rollout_longer_than_the_cache_fails_alone_and_frees_its_frames() -> None:
    async with open_runtime(build_model("vjepa2", kv_frames=6)) as runtime:
        engine = runtime.batching.engines["predictor"]
        with pytest.raises(RequestError, match="larger kv_frames"):
            await rollout(runtime, horizon=10)
        assert engine.frames_in_use == 0
        assert len(await rollout(runtime, horizon=4)) == 4


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"horizon": 0}, "horizon must be in 1..256"),
        ({"video": torch.zeros(2, 3, 8, 8)}, r"video must be a tensor of shape \[2, 3, 32, 32\]"),
        ({"actions": torch.zeros(3, 7), "horizon": 4}, r"actions must be .*\[4, 7\]"),
    ],
)
async def test_bad_inputs_fail_with_a_message_naming_them(
    inputs: dict[str, Any], message: str
) -> None:
    async with open_runtime(build_model("vjepa2")) as runtime:
        with pytest.raises(RequestError, match=message):
            await rollout(runtime, **inputs)


def test_mstar_run_prints_each_latent_and_the_time(capsys: pytest.CaptureFixture[str]) -> None:
    from mstar_async.cli import main

    assert main(["run", "vjepa2", "--horizon", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"latent step {i}: 16x32" for i in range(3)]
    assert lines[3].startswith("first output after") and "request took" in lines[3]
    assert main(["run", "vjepa2", "--horizon", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["latents"] == [{"step": i, "shape": [16, 32]} for i in range(2)]
