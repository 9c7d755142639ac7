"""``causal-lm``: text generation from any Llama/Qwen2 checkpoint folder (default: SmolLM2).

Two walks: ``prefill`` computes the prompt's KV and samples the first token; ``decode`` is a
``DynamicLoop`` of single-token steps that each request leaves on its own (a stop token, or its
``max_tokens``). The sampled token of ``prefill`` reaches ``decode`` along an edge of the graph,
kept in the request's state between the two walks. Tokens become text through an incremental
detokenizer, so multi-byte characters split across tokens arrive whole.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.errors import WalkInputError
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
from mstar_async.models.checkpoints.gguf_tensors import GGUFTensors
from mstar_async.models.checkpoints.smollm2 import default_cache_dir, smollm2_gguf_path
from mstar_async.models.context import decoder_context
from mstar_async.models.dtypes import DTYPES
from mstar_async.models.llama import DecoderConfig, PagedDecoder
from mstar_async.models.quant.decoder import FORMS, check_form
from mstar_async.models.quant.packed_cache import cached_quantized, packed_path
from mstar_async.models.registry import register
from mstar_async.models.stop_strings import StopStrings
from mstar_async.outputs import TextDelta, TextEnd

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
#: The weight form ``quantize="auto"`` gives the embedded SmolLM2 in bfloat16.
SMOLLM2_FORM: str | None = "int4"


def load_decoder(
    folder: Path,
    *,
    dtype: torch.dtype,
    device: str,
    quantize: str | None = None,
    gguf: Path | None = None,
) -> PagedDecoder:
    """The decoder of the checkpoint in ``folder`` on ``device``, read tensor by tensor, in
    ``dtype`` or, with ``quantize``, its linears in that weight form (see
    ``PagedDecoder.from_source``). ``gguf`` names a GGUF file to read the weights from instead
    of the folder's safetensors (its blocks are kept where the form takes them); a quantized
    form of it is packed once and read back from the cache directory on later starts
    (``quant.packed_cache``). Blocks on the reads.

    Raises:
        CheckpointError: a file is missing or unreadable.
        ValueError: the weights do not match the config; ``quantize`` names no form.
        QuantizationUnsupported: the form needs a kernel this torch lacks on ``device``.
    """
    config = read_config(folder)

    def build() -> PagedDecoder:
        source = SafetensorsFolder(folder) if gguf is None else GGUFTensors(gguf, config)
        return PagedDecoder.from_source(
            config, source, dtype=dtype, device=device, quantize=quantize
        )

    if gguf is None or quantize is None:
        return build()
    path = packed_path(gguf, quantize, dtype, default_cache_dir())
    return cached_quantized(config, path, build, dtype=dtype, device=device)


def build_lm_engine(
    folder: Path,
    *,
    dtype: torch.dtype,
    kv_cache_bytes: int,
    device: str,
    compile: bool | str,
    quantize: str | None = None,
    gguf: Path | None = None,
) -> KVCacheEngine:
    """``load_decoder`` wrapped in a ``KVCacheEngine``. Blocks on the reads.

    Raises:
        As ``load_decoder``.
    """
    model = load_decoder(folder, dtype=dtype, device=device, quantize=quantize, gguf=gguf)
    if compile:
        # Compiled kernels outlive the process, so a later start loads them (seconds, not
        # the cold compile's tens); an explicit TORCHINDUCTOR_CACHE_DIR wins.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir() / "inductor"))
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
        if len(ids) == 0:
            raise WalkInputError(
                "the prompt is empty: pass prompt='...' (mstar run: --prompt TEXT) or "
                "messages=[...]"
            )
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


def weight_form(quantize: str | None, *, embedded: bool, dtype: str) -> str | None:
    """The weight form ``quantize`` asks for: ``None`` (unquantized), ``"int8"`` or ``"int4"``.

    ``"auto"`` is ``SMOLLM2_FORM`` for the embedded SmolLM2 (``embedded``) in bfloat16, the
    form measured fastest within its quality bounds (``docs/benchmarks.md``), and unquantized
    otherwise (no quality has been measured for other checkpoints or dtypes); ``"none"`` and
    ``None`` are unquantized.

    Raises:
        ValueError: ``quantize`` is none of those.
    """
    if quantize == "auto":
        return SMOLLM2_FORM if embedded and dtype == "bfloat16" else None
    if quantize is None or quantize == "none":
        return None
    if quantize not in FORMS:
        raise ValueError(
            f"quantize must be one of auto, none, {', '.join(FORMS)}; got {quantize!r}"
        )
    return quantize


@register(
    "causal-lm",
    "a Llama/Qwen2 checkpoint folder (default SmolLM2-135M-Instruct) for text",
    required=("prompt",),
)
def build_causal_lm(
    path: str | Path | None = None,
    *,
    dtype: str = "bfloat16",
    quantize: str | None = "auto",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    device: str = "cpu",
    compile: bool | str = False,
    max_iterations: int = 4096,
) -> Model:
    """Build the text-generation model over the checkpoint folder ``path`` (SmolLM2 if None).

    The tokenizer and the config load here; the weights load when the engine is built on its
    worker. A request's prompt plus ``max_tokens`` may not pass the smaller of the config's
    ``max_position_embeddings`` and the tokens ``kv_cache_bytes`` holds (``model.context``).
    ``quantize`` picks the weight form (``weight_form``): the embedded SmolLM2 reads a
    quantized form's weights straight from its GGUF blocks, a folder's safetensors are
    quantized as they load; activations, the embedding and the norms stay in ``dtype``.
    ``compile`` (True for inductor, or a backend name) compiles each layer's work around its
    attention (``PagedDecoder.compile_layers``) on the first forward; inductor's kernels are
    kept under ``$MSTAR_CACHE/inductor`` for later starts.

    Raises:
        CheckpointError: the folder lacks a file it needs (the message names it).
        ValueError: ``dtype`` is not bfloat16, float16 or float32; ``quantize`` names no form;
            the config is not a supported decoder; ``kv_cache_bytes`` fits no KV block.
        QuantizationUnsupported: the form needs a kernel this torch lacks on ``device``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    form = weight_form(quantize, embedded=path is None, dtype=dtype)
    check_form(form, device)
    folder = Path(path) if path is not None else smollm2_folder()
    gguf = smollm2_gguf_path() if path is None and form is not None else None
    tokenizer = ChatTokenizer.from_folder(folder)
    config = DecoderConfig.from_hf(read_config(folder))
    context = decoder_context(config, dtype=DTYPES[dtype], kv_cache_bytes=kv_cache_bytes)
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
        dtype=DTYPES[dtype],
        kv_cache_bytes=kv_cache_bytes,
        device=device,
        compile=compile,
        quantize=form,
        gguf=gguf,
    )
    weights = "" if form is None else f" ({form} weights{' from its GGUF blocks' if gguf else ''})"
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
        description=f"text generation from {folder}{weights}",
        context=ContextLimit(context, _counter(tokenizer), token_chars=tokenizer.max_token_chars),
    )
