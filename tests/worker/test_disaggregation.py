"""Placements that cut a model across worker processes: prefill/decode, slow stream consumers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from tests.requests import collect_text
from tests.worker.models import BOUND, build_slow_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
PROMPTS = ["The capital of France is", "def main():", "we'll see what they're saying"]


@ONE_LOOP
@pytest.mark.anyio
async def test_prefill_decode_split_moves_the_kv_and_changes_no_token(
    tiny_folder: Path,
) -> None:
    def model() -> Any:
        return build_model("causal-lm", path=str(tiny_folder), dtype="float32")

    requests = [dict(prompt=p, max_tokens=16) for p in PROMPTS]
    async with open_runtime(model()) as runtime:
        expected = [await collect_text(runtime, **r) for r in requests]
    split = Placement.from_yaml(EXAMPLES / "prefill_decode.yaml")
    async with open_runtime(model(), placement=split) as runtime:
        got: dict[int, str] = {}

        async def one(i: int) -> None:
            got[i] = await collect_text(runtime, **requests[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    assert [got[i] for i in range(len(requests))] == expected
    assert all(expected)


@ONE_LOOP
@pytest.mark.anyio
async def test_a_slow_consumer_on_another_worker_holds_a_stepwise_producer_at_the_bound() -> None:
    placement = Placement(nodes={"sink": 1})
    async with open_runtime(build_slow_pipeline(), placement=placement) as runtime:
        # Run step by step on the conductor, as a walk whose loop spans ranks would (this one
        # would run as segments on the workers: tests/worker/test_segments.py).
        runtime.conductor.walks = runtime.conductor.walks.hosts_in_order[-1]  # type: ignore[attr-defined]
        with anyio.fail_after(120):
            async with runtime.generate(n=40) as outputs:
                seen = [item async for item in outputs]
        assert outputs.context is not None
        (walk,) = outputs.context.walk_streams
    assert seen == list(range(1, 41))
    # The conductor runs the walk; its streaming edge's producer ran ahead until the buffer
    # was full, and never further.
    assert walk._control.run.peak_buffered == BOUND  # type: ignore[union-attr]
