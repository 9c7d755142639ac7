"""pi05's cached expert, batched over prefixes of any lengths, against the uncached forward."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines import Step
from mstar_async.engines.prefix_cache import PrefixCacheEngine
from mstar_async.models.pi05.config import TINY
from mstar_async.models.pi05.gemma import Pi05Policy
from mstar_async.models.pi05.model import PolicyCache, build_policy
from mstar_async.models.pi05.reference import joint_velocity

pytestmark = pytest.mark.timeout(60)
CFG = TINY


@functools.cache
def policy() -> Pi05Policy:
    return build_policy(CFG)


def request(i: int, image_tokens: int, text_tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + i)
    return {
        "image_tokens": torch.randn(image_tokens, CFG.lm.width, generator=gen),
        "tokens": torch.randint(0, 256, (text_tokens,), generator=gen),
        "actions": torch.randn(CFG.action_horizon, CFG.action_dim, generator=gen),
        "time": torch.rand((), generator=gen),
    }


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 24)), min_size=1, max_size=5))
def test_batched_velocity_equals_the_joint_forward_of_each_request(
    shapes: list[tuple[int, int]],
) -> None:
    engine = PrefixCacheEngine(PolicyCache(policy()))
    reqs = [request(i, *shape) for i, shape in enumerate(shapes)]
    names = [f"r{i}" for i in range(len(reqs))]
    lengths = engine.forward(
        [
            Step(n, "prefix", {"image_tokens": r["image_tokens"], "tokens": r["tokens"]})
            for n, r in zip(names, reqs, strict=True)
        ]
    )
    assert [int(o["length"]) for o in lengths] == [a + b for a, b in shapes]  # type: ignore[index]
    out = engine.forward(
        [
            Step(n, "velocity", {"actions": r["actions"], "time": r["time"]})
            for n, r in zip(names, reqs, strict=True)
        ]
    )
    with torch.inference_mode():
        for r, result in zip(reqs, out, strict=True):
            prefix = policy().prefix_embeds(r["image_tokens"], r["tokens"])
            want = joint_velocity(policy(), prefix, r["actions"], r["time"])
            torch.testing.assert_close(result["velocity"], want, atol=2e-5, rtol=0)  # type: ignore[index]
