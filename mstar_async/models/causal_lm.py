"""``causal-lm``: text generation from any Llama/Qwen2 checkpoint folder (default: SmolLM2).

Two walks: ``prefill`` computes the prompt's KV and samples the first token; ``decode`` is a
``DynamicLoop`` of single-token steps that each request leaves on its own (a stop token, or its
``max_tokens``). The sampled token of ``prefill`` reaches ``decode`` along an edge of the graph,
kept in the request's state between the two walks. Tokens become text through an incremental
detokenizer, so multi-byte characters split across tokens arrive whole.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import (
    ContextLimit,
    DynamicLoop,
    Edge,
    LoopStep,
    Model,
    Node,
    TokenCounter,
    Walk,
)
from mstar_async.models.checkpoints import (
    ChatTokenizer,
    IncrementalDecoder,
    SafetensorsFolder,
    read_config,
    smollm2_folder,
)
from mstar_async.models.context import decoder_context
from mstar_async.models.llama import DecoderConfig, PagedDecoder
from mstar_async.models.registry import register
from mstar_async.models.stop_strings import StopStrings
from mstar_async.outputs import TextDelta, TextEnd

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def build_lm_engine(
    folder: Path,
    *,
    dtype: torch.dtype,
    kv_cache_bytes: int,
    device: str,
    compile: bool | str,
) -> KVCacheEngine:
    """Stream the checkpoint in ``folder`` onto ``device`` (tensor by tensor, in ``dtype``) and
    wrap it in a ``KVCacheEngine``. Blocks on the reads.

    Raises:
        CheckpointError: a file of the folder is missing or unreadable.
        ValueError: the weights do not match the config.
    """
    model = PagedDecoder.from_source(
        read_config(folder), SafetensorsFolder(folder), dtype=dtype, device=device
    )
    return KVCacheEngine(
        model,
        model.attention_spec(dtype),
        num_layers=model.config.num_hidden_layers,
        kv_cache_bytes=kv_cache_bytes,
        device=device,
        compile=compile,
    )


def _until(stop_ids: frozenset[int]) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        # The prefill already produced one token, so decode makes max_tokens - 1 at most.
        done = step.iteration + 2 >= int(step.params["max_tokens"])
        return done or int(step.outputs["decode.token"]) in step.params.get("stop_ids", stop_ids)

    return until


class _Text:
    """Sampled tokens to emitted text: incremental detokenizing, then stop strings."""

    def __init__(self, tokenizer: ChatTokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(stop)
        self.tokens = 0

    def push(self, token: int) -> str:
        self.tokens += 1
        return self.stops.push(self.detok.push(token))

    def finish(self) -> str:
        return self.stops.push(self.detok.finish()) + self.stops.finish()


def _prompt_ids(
    tokenizer: ChatTokenizer, prompt: str, messages: list[dict[str, str]] | None, chat: bool
) -> list[int]:
    # A prompt is continued as written (a completion); messages, or chat=True, go through
    # the checkpoint's chat template (a chat completion).
    if messages is not None or chat:
        conversation = messages or [{"role": "user", "content": prompt}]
        return tokenizer.encode(tokenizer.apply_chat_template(conversation))
    return tokenizer.encode(prompt)


def _counter(tokenizer: ChatTokenizer) -> TokenCounter:
    def count(inputs: Mapping[str, Any]) -> int:
        prompt, messages = inputs.get("prompt", ""), inputs.get("messages")
        return len(_prompt_ids(tokenizer, prompt, messages, bool(inputs.get("chat", False))))

    return count


def _program(tokenizer: ChatTokenizer) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        prompt: str = "",
        messages: list[dict[str, str]] | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        chat: bool = False,
        ignore_eos: bool = False,
        stop: list[str] | None = None,
    ) -> AsyncGenerator[Any, None]:
        stop_ids = frozenset() if ignore_eos else tokenizer.eos_token_ids
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
        )
        ids = torch.tensor(_prompt_ids(tokenizer, prompt, messages, chat), dtype=torch.long)
        out = _Text(tokenizer, stop or [])
        reason = "length"
        first = int((await request.run("prefill", tokens=ids, sampling=sampling))["token"])
        if first in stop_ids:
            yield TextEnd(len(ids), 0, "stop")
            return
        if delta := out.push(first):
            yield TextDelta(delta)
        if max_tokens > 1 and not out.stops.stopped:
            params = {"max_tokens": max_tokens, "stop_ids": stop_ids}
            async with request.stream("decode", params=params) as tokens:
                async for event in tokens:
                    token = int(event.value)
                    if token in stop_ids:
                        reason = "stop"
                        break
                    if delta := out.push(token):
                        yield TextDelta(delta)
                    if out.stops.stopped:
                        break
        if tail := out.finish():
            yield TextDelta(tail)
        yield TextEnd(len(ids), out.tokens, "stop" if out.stops.stopped else reason)

    return program


@register("causal-lm", "a Llama/Qwen2 checkpoint folder (default SmolLM2-135M-Instruct) for text")
def build_causal_lm(
    path: str | Path | None = None,
    *,
    dtype: str = "bfloat16",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    device: str = "cpu",
    compile: bool | str = False,
    max_iterations: int = 4096,
) -> Model:
    """Build the text-generation model over the checkpoint folder ``path`` (SmolLM2 if None).

    The tokenizer and the config load here; the weights load when the engine is built on its
    worker. A request's prompt plus ``max_tokens`` may not pass the smaller of the config's
    ``max_position_embeddings`` and the tokens ``kv_cache_bytes`` holds (``model.context``).

    Raises:
        CheckpointError: the folder lacks a file it needs (the message names it).
        ValueError: ``dtype`` is not bfloat16, float16 or float32; the config is not a
            supported decoder; ``kv_cache_bytes`` fits no KV block.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    folder = Path(path) if path is not None else smollm2_folder()
    tokenizer = ChatTokenizer.from_folder(folder)
    config = DecoderConfig.from_hf(read_config(folder))
    context = decoder_context(config, dtype=_DTYPES[dtype], kv_cache_bytes=kv_cache_bytes)
    nodes = [
        Node("prefill", engine="lm", inputs=["tokens", "sampling"], outputs=["token"]),
        Node("decode", engine="lm", inputs=["token"], outputs=["token"]),
    ]
    decode = DynamicLoop(
        "decode",
        until=_until(tokenizer.eos_token_ids),
        max_iterations=max_iterations,
        carry={"decode.token": "decode.token"},
    )
    factory = functools.partial(
        build_lm_engine,
        folder,
        dtype=_DTYPES[dtype],
        kv_cache_bytes=kv_cache_bytes,
        device=device,
        compile=compile,
    )
    return Model(
        "causal-lm",
        nodes=nodes,
        edges=[Edge("prefill.token", "decode.token")],
        walks=[
            Walk("prefill", "prefill", outputs=["prefill.token"]),
            Walk("decode", decode, outputs=["decode.token"]),
        ],
        program=_program(tokenizer),
        components={"lm": factory},
        description=f"text generation from {folder}",
        context=ContextLimit(context, _counter(tokenizer), token_chars=tokenizer.max_token_chars),
    )
