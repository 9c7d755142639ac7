"""The Orpheus language model: a Llama decoder whose vocabulary carries SNAC codes.

Seeded sizes (``tiny``, ``small``) are ``LlamaForCausalLM`` configs with Orpheus' rope (llama3,
theta 500 000) over the byte tokenizer's vocabulary plus the audio codes. Random weights alone
would emit tokens with no frame structure, so SNAC would hear almost nothing; the seeded weights
add a fixed *frame grammar* to the embeddings and the head (what a trained model learns): the
embedding of a code at frame position ``p`` points along a direction that the head rows of
position ``p + 1 (mod 7)`` codes align with, ``<start_of_speech>`` points at position 0, and
after a frame's last code ``<end_of_speech>`` gets a modest score. Everything else (attention,
MLPs, which code within a position wins) is random, computed by the unchanged architecture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.models.checkpoints import load_checkpoint
from mstar_async.models.checkpoints.streaming import StateDictSource
from mstar_async.models.llama import DecoderConfig, PagedDecoder
from mstar_async.models.orpheus.vocab import CODEBOOK_SIZE, CODES_PER_FRAME, OrpheusVocab

SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def hf_config(size: str, vocab: OrpheusVocab) -> dict[str, Any]:
    """The ``config.json`` of a seeded size: Llama with Orpheus' rope, untied head.

    Raises:
        ValueError: ``size`` is not one of ``SIZES``.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab.min_vocab_size + 2,  # upstream pads two ids past the last code
        **SIZES[size],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": vocab.bos,
        "eos_token_id": vocab.end_of_speech,
        "torch_dtype": "float32",
    }


def seeded_decoder(config: dict[str, Any], vocab: OrpheusVocab, seed: int) -> PagedDecoder:
    """A ``PagedDecoder`` with seeded random weights plus the frame grammar (module docstring)."""
    model = PagedDecoder.random(DecoderConfig.from_hf(config), seed)
    add_frame_grammar(model, vocab, seed)
    return model


# Strengths of the frame grammar, found by measuring the seeded sizes: EMBED lifts the grammar
# above what the random layers add to the residual stream (which grows with width and depth),
# HEAD makes the right position win by several logits, and END_OF_SPEECH gives sampling at
# temperature 0.6 utterances of a few to a hundred frames (greedy stops after one frame).
_EMBED, _HEAD, _END_MIX, _END_OF_SPEECH = 2.0, 8.0, 1.0, 1.5


def add_frame_grammar(model: PagedDecoder, vocab: OrpheusVocab, seed: int) -> None:
    """Add the frame grammar to ``model``'s embeddings and head, in place."""
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed + 1)
    # Eight orthonormal directions: one per frame position, one for end-of-speech.
    basis = torch.linalg.qr(torch.randn(hidden, CODES_PER_FRAME + 1, generator=gen))[0].T
    lift, gain = _EMBED * math.sqrt(hidden * layers), _HEAD / math.sqrt(hidden)
    end = basis[CODES_PER_FRAME].to(model.dtype)
    basis = basis.to(model.dtype)
    embed = model.model.embed_tokens.weight
    head = model.lm_head.weight
    assert isinstance(head, torch.Tensor)  # orpheus builds its decoder unquantized
    with torch.no_grad():
        for position in range(CODES_PER_FRAME):
            rows = slice(
                vocab.code_base + position * CODEBOOK_SIZE,
                vocab.code_base + (position + 1) * CODEBOOK_SIZE,
            )
            following = basis[(position + 1) % CODES_PER_FRAME]
            if position == CODES_PER_FRAME - 1:
                following = following + _END_MIX * end
            embed[rows] += lift * following
            head[rows] += gain * basis[position]
        embed[vocab.start_of_speech] += lift * basis[0]
        head[vocab.end_of_speech] += _END_OF_SPEECH * gain * end


def build_lm_engine(
    *,
    config: dict[str, Any] | None,
    vocab: OrpheusVocab,
    seed: int,
    path: Path | None,
    dtype: torch.dtype,
    kv_cache_bytes: int,
    device: str,
    quantize: str | None = None,
) -> KVCacheEngine:
    """The LM on a paged KV cache: a checkpoint folder's weights if ``path``, else seeded ones;
    with ``quantize`` (``"int8"``, ``"int4"``) its linears and head in that weight form,
    quantized as they are read.

    Raises:
        CheckpointError: the folder lacks a file it needs.
        ValueError: its weights do not match its config; ``quantize`` names no form.
        QuantizationUnsupported: the form needs a kernel this torch lacks on ``device``.
    """
    if path is not None:
        checkpoint = load_checkpoint(path)
        source = StateDictSource(checkpoint.state_dict)
        model = PagedDecoder.from_source(
            checkpoint.config, source, dtype=dtype, device=device, quantize=quantize
        )
    else:
        assert config is not None
        model = seeded_decoder(config, vocab, seed)
        if quantize is None:
            model = model.to(device=device, dtype=dtype)
        else:  # quantized as its seeded float weights are read
            source = StateDictSource(model.state_dict())
            model = PagedDecoder.from_source(
                config, source, dtype=dtype, device=device, quantize=quantize
            )
    return KVCacheEngine(
        model,
        model.attention_spec(dtype),
        num_layers=model.config.num_hidden_layers,
        kv_cache_bytes=kv_cache_bytes,
        device=device,
    )
