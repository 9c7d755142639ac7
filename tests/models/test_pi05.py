"""pi05 end to end: the cached, batched action expert against the uncached joint forward."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
import torch

from mstar_async.errors import MstarError, RequestError
from mstar_async.models import build_model
from mstar_async.models.pi05.config import TINY
from mstar_async.models.pi05.model import (
    build_policy,
    build_vision,
    initial_noise,
    synthetic_image,
    synthetic_state,
)
from mstar_async.models.pi05.prompt import tokenize
from mstar_async.models.pi05.reference import reference_actions
from mstar_async.outputs import ActionOutput
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
CFG = TINY
#: fp32 throughout; the cached path sums the same attention in a different order (padded keys
#: masked, prefix and actions concatenated once per layer), so results agree to rounding.
ATOL = 2e-5
INSTRUCTIONS = [
    "pick up the cup",
    "open the top drawer and put the red block inside it",
    "wipe",
    "fold the towel in half, then place it on the left side of the table",
]


async def act(runtime: Any, **inputs: Any) -> torch.Tensor:
    with anyio.fail_after(60):
        async with runtime.generate(**inputs) as outputs:
            items = [item async for item in outputs]
    assert len(items) == 1 and isinstance(items[0], ActionOutput)
    actions: torch.Tensor = items[0].actions
    return actions


def expected(instruction: str, seed: int, steps: int = 10) -> torch.Tensor:
    """The uncached reference: vision, prefix and every flow step recomputed from scratch."""
    policy, vision = build_policy(CFG), build_vision(CFG)
    with torch.inference_mode():
        image_tokens = vision.encode(synthetic_image(CFG, seed).unsqueeze(0))[0]
        prefix = policy.prefix_embeds(
            image_tokens, tokenize(instruction, synthetic_state(CFG, seed), CFG)
        )
    return reference_actions(policy, prefix, initial_noise(CFG, seed), steps)


async def test_cached_prefix_actions_match_the_full_forward_at_every_step() -> None:
    async with open_runtime(build_model("pi05")) as runtime:
        actions = await act(runtime, instruction=INSTRUCTIONS[1], seed=3)
        engine = runtime.batching.engines["policy"]
        assert engine.served["velocity"] == 10 and engine.served["prefix"] == 1
    assert actions.shape == (CFG.action_horizon, CFG.action_dim)
    reference = expected(INSTRUCTIONS[1], 3)
    torch.testing.assert_close(actions, reference, atol=ATOL, rtol=0)
    # The flow moved the chunk away from its starting noise.
    assert float((actions - initial_noise(CFG, 3)).abs().max()) > 0.1


async def test_concurrent_requests_of_different_lengths_match_each_alone() -> None:
    requests = [(text, seed) for seed, text in enumerate(INSTRUCTIONS * 2)]
    lengths = {int(tokenize(t, synthetic_state(CFG, s), CFG).numel()) for t, s in requests}
    assert len(lengths) >= 4
    async with open_runtime(build_model("pi05")) as runtime:
        alone = [await act(runtime, instruction=t, seed=s) for t, s in requests]
        engine = runtime.batching.engines["policy"]
        engine.suffix_batches.clear()
        together: dict[int, torch.Tensor] = {}

        async def one(i: int) -> None:
            together[i] = await act(runtime, instruction=requests[i][0], seed=requests[i][1])

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
        assert max(engine.suffix_batches) >= 4  # velocity steps of several requests batched
        assert engine.requests_held == 0
    for i, actions in enumerate(alone):
        torch.testing.assert_close(together[i], actions, atol=ATOL, rtol=0)
    torch.testing.assert_close(alone[0], expected(*requests[0]), atol=ATOL, rtol=0)


async def test_requests_beyond_max_requests_wait_for_a_release_and_still_match() -> None:
    requests = [(INSTRUCTIONS[i % 4], i) for i in range(5)]
    async with open_runtime(build_model("pi05", max_requests=2)) as runtime:
        together: dict[int, torch.Tensor] = {}

        async def one(i: int) -> None:
            together[i] = await act(runtime, instruction=requests[i][0], seed=requests[i][1])

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
        engine = runtime.batching.engines["policy"]
        assert engine.peak_requests == 2 and engine.requests_held == 0
        assert engine.served["prefix"] == 5
    for i in (0, 4):
        torch.testing.assert_close(together[i], expected(*requests[i]), atol=ATOL, rtol=0)


async def test_steps_sets_the_number_of_flow_iterations() -> None:
    async with open_runtime(build_model("pi05")) as runtime:
        engine = runtime.batching.engines["policy"]
        three = await act(runtime, instruction="wipe", seed=1, steps=3)
        assert engine.served["velocity"] == 3
        one = await act(runtime, instruction="wipe", seed=1, steps=1)
        assert engine.served["velocity"] == 4
    torch.testing.assert_close(three, expected("wipe", 1, steps=3), atol=ATOL, rtol=0)
    torch.testing.assert_close(one, expected("wipe", 1, steps=1), atol=ATOL, rtol=0)
    assert not torch.allclose(three, one, atol=1e-3)


async def test_prefix_is_freed_after_a_request_and_after_cancel() -> None:
    async with open_runtime(build_model("pi05")) as runtime:
        engine = runtime.batching.engines["policy"]
        await act(runtime, seed=2)
        assert engine.requests_held == 0 and engine.bytes_held == 0

        running = anyio.Event()
        forward = engine.forward
        loop = asyncio.get_running_loop()  # forwards run on the loop's thread or beside it

        def watched(steps: Any) -> Any:
            results = forward(steps)
            if engine.served["velocity"] >= 13:  # the loop is running on a held prefix
                loop.call_soon_threadsafe(running.set)
            return results

        engine.forward = watched

        async def endless() -> None:
            await act(runtime, seed=2, steps=100_000)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(endless)
                await running.wait()
                assert engine.requests_held == 1 and engine.bytes_held > 0
                tg.cancel_scope.cancel()
        assert engine.requests_held == 0 and engine.bytes_held == 0


async def test_bad_inputs_name_the_problem() -> None:
    async with open_runtime(build_model("pi05")) as runtime:
        with pytest.raises((MstarError, RequestError), match="state must be a vector of 4"):
            await act(runtime, state=torch.zeros(7))
        with pytest.raises(
            (MstarError, RequestError), match=r"image must be a \[3, height, width\]"
        ):
            await act(runtime, image=torch.zeros(64, 64))
        with pytest.raises((MstarError, RequestError), match="steps must be an int >= 1"):
            await act(runtime, steps=0)
        assert runtime.batching.engines["policy"].requests_held == 0


async def test_a_given_image_and_state_change_the_actions() -> None:
    image = torch.zeros(3, 64, 64)
    image[0, 16:48, 16:48] = 1.0
    async with open_runtime(build_model("pi05")) as runtime:
        default = await act(runtime, seed=4)
        with_image = await act(runtime, seed=4, image=image)
        with_state = await act(runtime, seed=4, state=torch.full((4,), 0.5))
    assert not torch.allclose(default, with_image, atol=1e-4)
    assert not torch.allclose(default, with_state, atol=1e-4)
