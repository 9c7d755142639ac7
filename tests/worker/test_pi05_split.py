"""pi05 across two worker processes: the prefix walk on one, the action loop on the other."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from mstar_async.models import build_model
from mstar_async.outputs import ActionOutput
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
REQUESTS = [("pick up the cup", 0), ("open the top drawer and put the red block inside it", 1)]


async def actions_of(runtime: object, instruction: str, seed: int) -> torch.Tensor:
    async with runtime.generate(instruction=instruction, seed=seed) as outputs:  # type: ignore[attr-defined]
        (item,) = [o async for o in outputs]
    assert isinstance(item, ActionOutput)
    return item.actions


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(150)
async def test_the_prefix_moves_to_the_action_rank_and_changes_no_action() -> None:
    with anyio.fail_after(140):
        async with open_runtime(build_model("pi05")) as runtime:
            expected = [await actions_of(runtime, *r) for r in REQUESTS]
        split = Placement.from_yaml(EXAMPLES / "pi05_split.yaml")
        (move,) = split.validate(build_model("pi05")).migrations
        assert (move.engine, move.from_walk, move.to_walk) == ("policy", "prefix", "act")
        async with open_runtime(build_model("pi05"), placement=split) as runtime:
            got: dict[int, torch.Tensor] = {}

            async def one(i: int) -> None:
                got[i] = await actions_of(runtime, *REQUESTS[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(REQUESTS)):
                    tg.start_soon(one, i)
    for i, want in enumerate(expected):
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)
