"""Each model's declared context limit: what its KV cache and positions hold, and a prompt
counted as its program encodes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from mstar_async.engines.kv.cache import capacity_tokens
from mstar_async.engines.kv.sizing import bytes_per_block
from mstar_async.errors import KVCacheFull, RequestError
from mstar_async.graph import Model
from mstar_async.models import build_model
from mstar_async.outputs import TextEnd
from mstar_async.runtime import open_runtime

pytestmark = pytest.mark.timeout(120)

#: The tiny Llama of ``tiny_folder``: 2 layers, 2 KV heads of 16 dims, 256 positions.
TINY_BLOCK = bytes_per_block(
    num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype_bytes=4
)


def _kv_tokens(engine: Any) -> int:
    return int(engine.allocator.num_blocks * engine.allocator.block_size)


def test_capacity_is_what_the_engine_allocates(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    engine = model.components["lm"]()
    spec, layers = engine.spec, engine.num_layers
    assert capacity_tokens(spec, num_layers=layers, kv_cache_bytes=5 * TINY_BLOCK + 1) == 80
    assert _kv_tokens(engine) == capacity_tokens(spec, num_layers=layers, kv_cache_bytes=256 << 20)


def test_causal_lm_takes_the_smaller_of_its_positions_and_its_kv(tiny_folder: Path) -> None:
    roomy = build_model("causal-lm", path=tiny_folder, dtype="float32")
    assert roomy.context is not None and roomy.context.tokens == 256  # max_position_embeddings
    small = build_model(
        "causal-lm", path=tiny_folder, dtype="float32", kv_cache_bytes=4 * TINY_BLOCK
    )
    assert small.context is not None
    assert small.context.tokens == _kv_tokens(small.components["lm"]()) == 64


@pytest.mark.anyio
async def test_the_count_is_what_the_program_prefills(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    assert model.context is not None
    for inputs in (
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"prompt": "Hi there", "chat": True},
    ):
        async with open_runtime(model) as runtime:
            with anyio.fail_after(60):
                async with runtime.generate(**inputs, max_tokens=1) as outputs:
                    ends = [o async for o in outputs if isinstance(o, TextEnd)]
        assert ends[0].prompt_tokens == model.context.count(inputs)


@pytest.mark.anyio
async def test_a_request_at_the_limit_runs_and_one_past_it_never_can(tiny_folder: Path) -> None:
    model = build_model(
        "causal-lm", path=tiny_folder, dtype="float32", kv_cache_bytes=4 * TINY_BLOCK
    )
    assert model.context is not None
    limit, count = model.context.tokens, model.context.count
    words = "we " * 200
    prompt = next(words[:n] for n in range(len(words)) if count({"prompt": words[:n]}) == 60)
    longer = next(words[:n] for n in range(len(words)) if count({"prompt": words[:n]}) == 61)
    async with open_runtime(model) as runtime:
        with anyio.fail_after(60):
            async with runtime.generate(
                prompt=prompt, max_tokens=limit - 60, ignore_eos=True
            ) as outputs:
                ends = [o async for o in outputs if isinstance(o, TextEnd)]
            assert ends[0].completion_tokens == limit - 60
            with pytest.raises(RequestError) as failed:
                async with runtime.generate(
                    prompt=longer, max_tokens=limit - 59, ignore_eos=True
                ) as outputs:
                    [o async for o in outputs]
    assert isinstance(failed.value.__cause__, KVCacheFull)


def _kv_engines(model: Model) -> list[Any]:
    # The predictor of qwen3-omni holds one frame's codebooks, never the prompt.
    engines = [build() for name, build in model.components.items() if name != "predictor"]
    return [e for e in engines if hasattr(e, "allocator")]


@pytest.mark.parametrize("name", ["orpheus", "qwen3-omni", "bagel"])
def test_the_speech_and_image_models_fit_their_limit_in_every_kv_cache(name: str) -> None:
    model = build_model(name)
    assert model.context is not None
    engines = _kv_engines(model)
    assert engines and model.context.tokens <= min(_kv_tokens(e) for e in engines)
    assert model.context.count({}) > 0  # the program's defaults make a prompt
