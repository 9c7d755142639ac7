"""``qwen3-tts``: a Qwen3-TTS-style talker (+ code predictor) -> 12 Hz speech decoder.

Graph (engines in brackets)::

    voice_encoder [voice]            reference PCM -> speaker embedding, reference codes
    talker_prefill [talker] --> ( predictor_prefill [predictor]
                                  -> Loop(predictor [predictor], G-2)   codebooks 1..G-1
                                  -> talker [talker] )                  DynamicLoop: one frame
                                            |  stream, LeftContextChunkPolicy(chunk, 25)
                                            v
                                     decoder [decoder] --> PCM

Walks: ``encode_voice`` (the two encoders, once per cloned voice), ``prefill`` (the talker's
prompt: named speaker, instruction, or a cloned voice's embedding and reference codes; a
registered voice's leading rows are computed once per talker rank and kept, evictable, under a
handle of the voice), ``speak`` (frames and decoding, pipelined) and ``forget_voice`` (drop
what a deleted voice left kept, the talker's rows and the decoder's state, on every replica).
The decoder's windows are upstream's ``chunked_decode`` windows (25 frames of left context)
at a streaming chunk size; for a voice cloned in context the first windows reach back into
the reference codes, which upstream decodes in front of the generated ones (a registered
voice's first window continues from the convolutions' state after them, kept per decoder
rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines import StatelessEngine
from mstar_async.engines.kv.cache import capacity_tokens
from mstar_async.graph import (
    ContextLimit,
    Edge,
    Model,
    Node,
    Parallel,
    Sequential,
    Walk,
    stream,
)
from mstar_async.models.checkpoints import ChatTokenizer, read_config, smollm2_folder
from mstar_async.models.dtypes import DTYPES
from mstar_async.models.qwen3_omni.code2wav import VoiceTails
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine
from mstar_async.models.qwen3_omni.frame_loop import (
    frame_edges,
    frame_loop,
    predictor_nodes,
    stack_engine,
)
from mstar_async.models.qwen3_omni.talker import predictor_ops
from mstar_async.models.qwen3_tts.config import (
    SAMPLE_RATE,
    SIZES,
    TTSConfig,
    with_released_encoders,
)
from mstar_async.models.qwen3_tts.program import make_program
from mstar_async.models.qwen3_tts.prompt import PromptIds
from mstar_async.models.qwen3_tts.talker import TalkerIds, talker_ops
from mstar_async.models.qwen3_tts.weights import TTSWeights
from mstar_async.models.registry import register
from mstar_async.policies import LeftContextChunkPolicy

__all__ = ["CHUNK", "LEFT_CONTEXT", "build_qwen3_tts", "prompt_ids", "seeded_config"]

#: Frames per decoder window (0.64 s) and upstream's left context (2 s).
CHUNK = 8
LEFT_CONTEXT = 25
DEFAULT_KV_CACHE_BYTES = 64 * 2**20


def prompt_ids(cfg: TTSConfig, tokenizer: ChatTokenizer) -> PromptIds:
    """The layout's special ids for ``cfg`` over ``tokenizer`` (tts ids past its vocabulary
    when the config has none)."""
    base = tokenizer.vocab_size
    return PromptIds(
        codec_pad=cfg.codec_pad,
        codec_bos=cfg.codec_bos,
        codec_think=cfg.codec_think,
        codec_nothink=cfg.codec_nothink,
        codec_think_bos=cfg.codec_think_bos,
        codec_think_eos=cfg.codec_think_eos,
        tts_bos=base if cfg.tts_bos is None else cfg.tts_bos,
        tts_eos=base + 1 if cfg.tts_eos is None else cfg.tts_eos,
        tts_pad=base + 2 if cfg.tts_pad is None else cfg.tts_pad,
        groups=cfg.num_code_groups,
    )


# ------------------------------------------------------------------------------ engines


def _talker_engine(weights: TTSWeights, ids: TalkerIds, kv: int) -> EmbedsKVEngine:
    talker = weights.talker()
    return stack_engine(talker.model, weights.config.talker, talker_ops(talker, ids), kv, weights)


def _predictor_engine(weights: TTSWeights, kv: int) -> EmbedsKVEngine:
    predictor = weights.talker().code_predictor
    ops = predictor_ops(predictor)
    return stack_engine(predictor.model, weights.config.predictor, ops, kv, weights)


def _decoder_engine(weights: TTSWeights, left_context: int) -> StatelessEngine:
    decoder = weights.speech_decoder()
    # Per decoder rank, like the talker's kept prompt rows: a registered voice's first window
    # continues from the convolutions' state after its reference frames.
    voices = VoiceTails()
    decode = functools.partial(decoder.decode, left_context=left_context, voices=voices)
    return StatelessEngine({"decode": decode, "forget": voices.forget}, device=weights.device)


def _voice_engine(weights: TTSWeights) -> StatelessEngine:
    # Held for the engine's life: the weights keep a part only while someone holds it, and
    # building the encoders again for every cloned voice cost more than running them.
    speaker_encoder = functools.cache(weights.speaker_encoder)
    speech_encoder = functools.cache(weights.speech_encoder)

    def encode(
        pcm: Sequence[torch.Tensor], with_codes: Sequence[bool] | torch.Tensor
    ) -> dict[str, list[torch.Tensor]]:
        # The codec encoder runs only for voices cloned in context (x-vector voices skip it).
        speaker = speaker_encoder()
        groups = weights.config.num_code_groups
        codes = [
            speech_encoder().encode(p.float().reshape(-1))
            if bool(want)
            else torch.zeros(0, groups, dtype=torch.long)
            for p, want in zip(pcm, with_codes, strict=True)
        ]
        return {"speaker": [speaker.embed(p.float().reshape(-1)) for p in pcm], "codes": codes}

    return StatelessEngine({"encode": encode})


# ------------------------------------------------------------------------------ graph


def _nodes() -> list[Node]:
    return [
        Node(
            "voice_encoder",
            engine="voice",
            op="encode",
            inputs=["pcm", "with_codes"],
            outputs=["speaker", "codes"],
        ),
        Node(
            "talker_prefill",
            engine="talker",
            op="prefill",
            inputs=["layout", "speaker", "sampling", "voice_id", "voice_rows", "resume", "keep"],
            outputs=["code", "context", "history"],
        ),
        # A registered voice's kept prompt rows, dropped when the voice is deleted.
        Node("talker_forget", engine="talker", op="drop", inputs=["handle"], outputs=["dropped"]),
        *predictor_nodes(),
        Node(
            "talker",
            engine="talker",
            op="decode",
            inputs=["code", "codes", "trailing", "history"],
            outputs=["frame", "code", "context", "history"],
        ),
        Node(
            "decoder",
            engine="decoder",
            op="decode",
            inputs=["codes", "prime", "voice"],
            outputs=["pcm"],
        ),
        Node(
            "decoder_forget", engine="decoder", op="forget", inputs=["handle"], outputs=["dropped"]
        ),
    ]


def _edges(chunk: int, left_context: int) -> list[Any]:
    return [
        *frame_edges(),
        Edge("talker_prefill.history", "talker.history"),
        stream("talker.frame", "decoder.codes", LeftContextChunkPolicy(chunk, left_context)),
    ]


def _walks(cfg: TTSConfig, max_iterations: int) -> list[Walk]:
    frames = frame_loop(
        cfg.num_code_groups,
        cfg.codec_eos,
        max_iterations,
        carry={"talker.history": "talker.history"},
    )
    return [
        Walk(
            "encode_voice",
            "voice_encoder",
            outputs=["voice_encoder.speaker", "voice_encoder.codes"],
        ),
        Walk("prefill", "talker_prefill", outputs=["talker_prefill.code"]),
        Walk(
            "forget_voice",
            Parallel("talker_forget", "decoder_forget"),
            outputs=["talker_forget.dropped", "decoder_forget.dropped"],
        ),
        Walk("speak", Sequential(frames, "decoder"), outputs=["talker.frame", "decoder.pcm"]),
    ]


# ------------------------------------------------------------------------------ builder


def seeded_config(size: str, seed: int, tokenizer: ChatTokenizer) -> TTSConfig:
    """The seeded model's config: ``size``'s shapes over ``tokenizer``'s vocabulary plus the
    three tts ids.

    Raises:
        ValueError: an unknown size.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; sizes: {sorted(SIZES)}")
    return replace(SIZES[size], text_vocab=tokenizer.vocab_size + 3, seed=seed)


def _counter(tokenizer: ChatTokenizer) -> Callable[[Mapping[str, Any]], int]:
    def count(inputs: Mapping[str, Any]) -> int:
        # The text and instruction rows plus the codec tags; a cloned voice's reference frames
        # are bounded by the voice registry's limits.
        text = f"{inputs.get('text', '')} {inputs.get('instruct', '')}"
        return len(tokenizer.encode(text)) + 16

    return count


@register(
    "qwen3-tts",
    "Qwen3-TTS-style talker + code predictor -> 12 Hz speech decoder; named, described and "
    "cloned voices, 24 kHz",
    required=("text",),
)
def build_qwen3_tts(
    path: str | Path | None = None,
    *,
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_iterations: int = 4096,
    chunk: int = CHUNK,
    left_context: int = LEFT_CONTEXT,
    encoders: str = "seeded",
) -> Model:
    """Build the model: seeded weights of ``size`` (``tiny`` or ``small``) over the SmolLM2
    tokenizer, or, with ``path``, a Qwen3-TTS checkpoint folder (``config.json``, tokenizer,
    ``model.safetensors``, ``speech_tokenizer/{config.json,model.safetensors}``). The
    tokenizer loads here; weights when the engines are built on their worker.
    ``encoders="released"`` gives a seeded model the released encoders' shapes
    (``with_released_encoders``).

    Raises:
        ValueError: an unknown ``size``, ``dtype`` or ``encoders``; ``chunk`` below 1;
            ``encoders="released"`` with a checkpoint (it has its own).
        CheckpointError: the folder lacks a file it needs.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if chunk < 1 or left_context < 0:
        raise ValueError(f"chunk must be >= 1 and left_context >= 0, got {chunk}, {left_context}")
    if encoders not in ("seeded", "released"):
        raise ValueError(f"encoders must be 'seeded' or 'released', got {encoders!r}")
    folder = Path(path) if path is not None else None
    if folder is not None and encoders != "seeded":
        raise ValueError("encoders='released' shapes a seeded model; a checkpoint has its own")
    if folder is None:
        tokenizer = ChatTokenizer.from_folder(smollm2_folder())
        cfg = seeded_config(size, seed, tokenizer)
        if encoders == "released":
            cfg = with_released_encoders(cfg)
    else:
        tokenizer = ChatTokenizer.from_folder(folder)
        cfg = TTSConfig.from_hf(read_config(folder), read_config(folder / "speech_tokenizer"))
    ids = prompt_ids(cfg, tokenizer)
    talker_ids = TalkerIds(cfg.codebook_size, cfg.codec_eos, ids.tts_pad)
    torch_dtype = DTYPES[dtype]
    weights = TTSWeights(cfg, folder, torch_dtype, device)
    context = capacity_tokens(
        cfg.talker.attention_spec(torch_dtype),
        num_layers=cfg.talker.num_hidden_layers,
        kv_cache_bytes=kv_cache_bytes,
    )
    return Model(
        "qwen3-tts",
        nodes=_nodes(),
        edges=_edges(chunk, left_context),
        walks=_walks(cfg, max_iterations),
        program=make_program(tokenizer, cfg, ids, left_context),
        components={
            "voice": functools.partial(_voice_engine, weights),
            "talker": functools.partial(_talker_engine, weights, talker_ids, kv_cache_bytes),
            "predictor": functools.partial(_predictor_engine, weights, kv_cache_bytes // 4),
            "decoder": functools.partial(_decoder_engine, weights, left_context),
        },
        description=f"qwen3-tts ({'seeded ' + size if folder is None else folder})",
        info={
            "sample_rate": SAMPLE_RATE,
            "voice_input": "speaker",
            "voices": sorted(dict(cfg.speakers)),
            "clones_voices": cfg.can_clone,
            # The program takes forget_voice=<id>: the registry drops a deleted voice's KV.
            "keeps_voice_kv": True,
            "codec_groups": cfg.num_code_groups,
        },
        context=ContextLimit(context, _counter(tokenizer), token_chars=tokenizer.max_token_chars),
    )
