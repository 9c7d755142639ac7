"""``orpheus``: text to 24 kHz speech with a Llama LM that speaks SNAC codes, streamed.

Two walks. ``prefill`` computes the prompt's KV (all but its last token, ``<start_of_speech>``).
``speak`` is a ``DynamicLoop`` of decode steps, fed ``<start_of_speech>`` first, that each
request leaves on ``<end_of_speech>`` or at its ``max_tokens``; every sampled token streams over
a ``LeftContextChunkPolicy(7, 7, 14)`` edge into the SNAC decoder, which turns each frame into
PCM, decoded with one frame before it and two after it as upstream's 28-code windows do, while
the LM keeps going (see ``snac_codec``). Feeding the prompt's last token to the loop makes
every audio code a loop output, so the first code reaches SNAC like all the others.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines import StatelessEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import (
    ContextLimit,
    DynamicLoop,
    LoopStep,
    Model,
    Node,
    Sequential,
    TokenCounter,
    Walk,
    stream,
)
from mstar_async.models.checkpoints import ChatTokenizer, read_config
from mstar_async.models.context import decoder_context
from mstar_async.models.dtypes import DTYPES
from mstar_async.models.llama import DecoderConfig
from mstar_async.models.orpheus.lm import SIZES, build_lm_engine, hf_config
from mstar_async.models.orpheus.snac_codec import (
    SNAC_24KHZ,
    SNAC_SMALL,
    SNAC_TINY,
    SnacWindowDecoder,
    build_snac,
    check_snac_folder,
    load_snac,
    snac_policy,
)
from mstar_async.models.orpheus.text import byte_tokenizer, vocab_of
from mstar_async.models.orpheus.vocab import VOICES, OrpheusVocab, prompt_text
from mstar_async.models.quant.decoder import check_form
from mstar_async.models.registry import register
from mstar_async.outputs import AudioChunk

DEFAULT_KV_CACHE_BYTES = 256 * 2**20
SAMPLE_RATE = 24_000
_SNAC_CONFIGS = {"tiny": SNAC_TINY, "small": SNAC_SMALL, "full": SNAC_24KHZ}
_DEFAULT_TEXT = "Hello there, how are you?"
_DEFAULT_VOICE = "tara"


def _snac_engine(
    vocab: OrpheusVocab, snac_path: Path | None, config: dict[str, Any], seed: int
) -> StatelessEngine:
    snac = load_snac(snac_path) if snac_path is not None else build_snac(config, seed)
    return StatelessEngine({"decode": SnacWindowDecoder(snac, vocab)})


def _until(end_of_speech: int) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        if int(step.outputs["decode.token"]) == end_of_speech:
            return True
        return step.iteration + 1 >= int(step.params["max_tokens"])

    return until


def _check_voice(voice: str, voices: tuple[str, ...]) -> None:
    if voice and voice not in voices:
        raise ValueError(f"unknown voice {voice!r}; voices: {', '.join(voices)} (or '' for none)")


def _prompt_ids(tokenizer: ChatTokenizer, vocab: OrpheusVocab, text: str, voice: str) -> list[int]:
    return vocab.prompt_ids(tokenizer.encode(prompt_text(text, voice), add_special_tokens=True))


def _counter(tokenizer: ChatTokenizer, vocab: OrpheusVocab, voice: str) -> TokenCounter:
    def count(inputs: Mapping[str, Any]) -> int:
        text = inputs.get("text", _DEFAULT_TEXT)
        return len(_prompt_ids(tokenizer, vocab, text, inputs.get("voice", voice)))

    return count


def _program(
    tokenizer: ChatTokenizer, vocab: OrpheusVocab, voices: tuple[str, ...]
) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        text: str = _DEFAULT_TEXT,
        voice: str = _DEFAULT_VOICE,
        max_tokens: int = 1200,
        temperature: float = 0.6,
        top_p: float = 0.8,
        seed: int = 0,
    ) -> AsyncGenerator[Any, None]:
        _check_voice(voice, voices)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = _prompt_ids(tokenizer, vocab, text, voice)
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=frozenset({vocab.end_of_speech}),
        )
        await request.run("prefill", tokens=torch.tensor(ids[:-1]), sampling=sampling)
        first = torch.tensor(ids[-1])
        async with request.stream("speak", params={"max_tokens": max_tokens}, token=first) as s:
            async for event in s:
                if event.value.numel():
                    yield AudioChunk(event.value, SAMPLE_RATE)

    return program


@register(
    "orpheus",
    "Orpheus-style TTS: Llama LM over SNAC codes -> streaming 24 kHz speech",
    required=("text",),
)
def build_orpheus(
    size: str = "tiny",
    *,
    path: str | Path | None = None,
    snac_path: str | Path | None = None,
    seed: int = 0,
    dtype: str = "float32",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    device: str = "cpu",
    max_iterations: int = 4096,
    voices: tuple[str, ...] = VOICES,
    snac: str | None = None,
    quantize: str | None = None,
) -> Model:
    """Build Orpheus: seeded weights at ``size`` (``tiny``, ``small``), or a real checkpoint.

    ``path`` is an Orpheus Hugging Face folder (Llama config, safetensors weights by upstream
    names, tokenizer.json); ``snac_path`` a SNAC folder (config.json, pytorch_model.bin). Either
    replaces its seeded part. ``snac`` picks the seeded codec's config instead of the size's:
    ``tiny``, ``small`` or ``full`` (``hubertsiuzdak/snac_24khz``'s). The tokenizer loads here;
    weights load when engines are built. A request's prompt plus ``max_tokens`` may not pass
    the smaller of the LM's ``max_position_embeddings`` and the tokens ``kv_cache_bytes``
    holds (``model.context``). ``quantize`` (``"int8"``, ``"int4"``) runs the LM's linears and
    head through weight-only kernels (``docs/engines.md``); the codec stays float32.

    Raises:
        CheckpointError: a folder lacks a file it needs, or its tokenizer lacks Orpheus' tokens.
        ValueError: an unknown ``size``, ``snac``, ``dtype`` or ``quantize``;
            ``kv_cache_bytes`` fits no KV block.
        QuantizationUnsupported: ``quantize`` needs a kernel this torch lacks on ``device``.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    snac_config = _SNAC_CONFIGS.get(snac or size)
    if snac_config is None:
        raise ValueError(f"snac must be one of {sorted(_SNAC_CONFIGS)}, got {snac!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_form(quantize, device)
    folder = Path(path) if path is not None else None
    tokenizer = ChatTokenizer.from_folder(folder) if folder is not None else byte_tokenizer()
    vocab = vocab_of(tokenizer)
    config = hf_config(size, vocab) if folder is None else read_config(folder)
    context = decoder_context(
        DecoderConfig.from_hf(config), dtype=DTYPES[dtype], kv_cache_bytes=kv_cache_bytes
    )
    lm = functools.partial(
        build_lm_engine,
        config=None if folder is not None else config,
        vocab=vocab,
        seed=seed,
        path=folder,
        dtype=DTYPES[dtype],
        kv_cache_bytes=kv_cache_bytes,
        device=device,
        quantize=quantize,
    )
    snac_folder = Path(snac_path) if snac_path is not None else None
    if snac_folder is not None:
        check_snac_folder(snac_folder)  # the weights load on the codec's worker, later
    codec = functools.partial(_snac_engine, vocab, snac_folder, snac_config, seed + 7)
    speak = DynamicLoop(
        "decode",
        until=_until(vocab.end_of_speech),
        max_iterations=max_iterations,
        carry={"decode.token": "decode.token"},
    )
    return Model(
        "orpheus",
        nodes=[
            Node("prefill", engine="lm", inputs=["tokens", "sampling"], outputs=["token"]),
            Node("decode", engine="lm", inputs=["token"], outputs=["token"]),
            Node("snac", engine="snac", op="decode", inputs=["codes"], outputs=["pcm"]),
        ],
        edges=[stream("decode.token", "snac.codes", snac_policy())],
        walks=[
            Walk("prefill", "prefill", outputs=["prefill.token"]),
            Walk("speak", Sequential(speak, "snac"), outputs=["snac.pcm"]),
        ],
        program=_program(tokenizer, vocab, voices),
        components={"lm": lm, "snac": codec},
        description=f"Orpheus TTS ({folder or size}) with SNAC ({snac_folder or size})",
        info={"sample_rate": SAMPLE_RATE, "voice_input": "voice", "voices": list(voices)},
        context=ContextLimit(
            context,
            _counter(tokenizer, vocab, _DEFAULT_VOICE),
            token_chars=tokenizer.max_token_chars,
        ),
    )
