"""PagedDecoder against transformers' LlamaForCausalLM / Qwen2ForCausalLM, through the paged cache.

Each variant is a small random Hugging Face model saved with ``save_pretrained`` (safetensors),
read back as ``config.json`` + ``load_file`` and loaded with ``PagedDecoder.from_checkpoint``.
Weights are re-drawn at ``1/sqrt(fan_in)`` scale (upstream's 0.02 init makes attention nearly
uniform, which would hide position and masking bugs). Reference attention for our side is the
existing paged KV cache (allocator + PagedKVCache + TorchAttentionBackend) with a scrambled free
list, so block tables are not contiguous.

Tolerances, float32 (max abs logit difference; logits are O(1..10)):
    vs transformers (eager attention):    atol 1e-4   (observed 1.9e-6 .. 2.4e-6)
    batched / chunked vs alone (ours):    atol 2e-5   (observed 1.2e-6 .. 2.7e-6)
    bfloat16 vs transformers in bfloat16: atol 0.25   (observed 0.05 .. 0.06; bf16 rounding,
                                                       and SDPA vs eager attention)
Greedy decoding must give exactly the same 32 tokens as transformers' greedy loop.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mstar_async.engines.kv import (
    BatchLayout,
    PagedKVAllocator,
    PagedKVCache,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from mstar_async.errors import EngineError
from mstar_async.models.llama import DecoderConfig, PagedDecoder, RopeConfig

transformers = pytest.importorskip("transformers")

HF_ATOL = 1e-4
SELF_ATOL = 2e-5
BF16_ATOL = 0.25
PROMPT_LEN = 20
DECODE_STEPS = 32

SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "llama",
        {"num_hidden_layers": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    ),
    # Tied embeddings, llama3 rope scaling (with a short original context so that the low,
    # medium and high frequency bands all occur at head_dim 16), and every optional bias.
    "llama-tied-llama3": (
        "llama",
        {
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": (
        "qwen2",
        {"num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
}


# ---------------------------------------------------------------------------------- helpers


def hf_model(kind: str, extra: Mapping[str, Any], seed: int) -> Any:
    """A small random transformers model in float32, eager attention, eval mode."""
    cls_cfg = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    cls_lm = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    config = cls_cfg(**SMALL, **extra, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls_lm(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.1)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                else:
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    return model.eval()


@dataclass
class Pair:
    hf: Any
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    decoder: PagedDecoder


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    kind, extra = VARIANTS[request.param]
    model = hf_model(kind, extra, seed=list(VARIANTS).index(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    state_dict = load_file(str(folder / "model.safetensors"))
    decoder = PagedDecoder.from_checkpoint(config, state_dict)
    return Pair(model, config, state_dict, decoder)


class RefPagedAttention:
    """The engine's side of the seam, in miniature: plan a step on the paged cache, then per
    layer write this step's K/V and attend through the torch backend."""

    def __init__(
        self,
        decoder: PagedDecoder,
        *,
        num_blocks: int = 96,
        block_size: int = 4,
        pad_waste_limit: float = 2.0,
        seed: int = 0,
    ) -> None:
        spec = decoder.attention_spec()
        self.alloc = PagedKVAllocator(num_blocks, block_size)
        self.cache = PagedKVCache(
            num_layers=decoder.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
        )
        self.cache.kv.normal_()  # garbage in unused slots must never be read
        self.backend = TorchAttentionBackend(spec, "cpu", pad_waste_limit=pad_waste_limit)
        self.meta: TorchAttentionMetadata | None = None
        # Hand blocks out in a random order, so block tables are neither contiguous nor sorted.
        order = list(range(num_blocks))
        for b in order:
            self.alloc.add(("scramble", b))
            self.alloc.append(("scramble", b), 1)
        random.Random(seed).shuffle(order)
        for b in order:
            self.alloc.free(("scramble", b))

    def plan(self, lengths: Mapping[Hashable, int]) -> None:
        for seq in lengths:
            if not self.alloc.has(seq):
                self.alloc.add(seq)
        plans = self.alloc.append_batch(lengths)
        self.cache.copy_blocks([c for p in plans for c in p.copies])
        self.meta = self.backend.plan(BatchLayout.from_plans(self.alloc, plans))

    @property
    def positions(self) -> torch.Tensor:
        assert self.meta is not None
        return self.meta.positions

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self.meta is not None
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        return self.backend.forward(q, self.cache.key(layer), self.cache.value(layer), self.meta)


def step(
    decoder: PagedDecoder, att: RefPagedAttention, batch: Mapping[Hashable, Sequence[int]]
) -> dict[Hashable, torch.Tensor]:
    """Run one flat forward over ``batch`` (new tokens per sequence); logits per sequence."""
    att.plan({seq: len(tokens) for seq, tokens in batch.items()})
    ids = torch.tensor([t for tokens in batch.values() for t in tokens], dtype=torch.long)
    with torch.no_grad():
        logits = decoder.compute_logits(decoder(ids, att))
    out: dict[Hashable, torch.Tensor] = {}
    start = 0
    for seq, tokens in batch.items():
        out[seq] = logits[start : start + len(tokens)]
        start += len(tokens)
    return out


def prompt(n: int, seed: int, vocab: int = SMALL["vocab_size"]) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([list(tokens)])).logits[0]
    return logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------- parity


def test_prefill_logits_match_transformers(pair: Pair) -> None:
    tokens = prompt(PROMPT_LEN, seed=1)
    ours = step(pair.decoder, RefPagedAttention(pair.decoder), {"a": tokens})["a"]
    ref = hf_logits(pair.hf, tokens)
    assert ours.shape == ref.shape == (PROMPT_LEN, SMALL["vocab_size"])
    assert ref.abs().max() > 1.0, "logits too flat for the check to mean anything"
    assert max_diff(ours, ref) <= HF_ATOL


def test_greedy_decode_matches_transformers(pair: Pair) -> None:
    tokens = prompt(PROMPT_LEN, seed=2)
    att = RefPagedAttention(pair.decoder)
    logits = step(pair.decoder, att, {"a": tokens})["a"][-1]
    ours: list[int] = []
    ours_logits = []
    for _ in range(DECODE_STEPS):
        ours_logits.append(logits)
        ours.append(int(logits.argmax()))
        logits = step(pair.decoder, att, {"a": [ours[-1]]})["a"][-1]
    # Reference: transformers' greedy loop, re-running the whole sequence at each step.
    seq = list(tokens)
    ref_logits = []
    for _ in range(DECODE_STEPS):
        ref_logits.append(hf_logits(pair.hf, seq)[-1])
        seq.append(int(ref_logits[-1].argmax()))
    assert ours == seq[PROMPT_LEN:]
    assert max_diff(torch.stack(ours_logits), torch.stack(ref_logits)) <= HF_ATOL
    assert len(set(ours)) > 3, "degenerate model: greedy repeats one token"


def test_batch_of_three_equals_each_alone(pair: Pair) -> None:
    dec = pair.decoder
    prompts = {"a": prompt(5, 3), "b": prompt(17, 4), "c": prompt(11, 5)}
    alone = {}
    for seq, tokens in prompts.items():
        att = RefPagedAttention(dec, seed=7)
        first = step(dec, att, {seq: tokens})[seq][-1]
        nxt = int(first.argmax())
        alone[seq] = (first, nxt, step(dec, att, {seq: [nxt]})[seq][-1])
    att = RefPagedAttention(dec, seed=8)
    batched = step(dec, att, prompts)
    for seq in prompts:
        assert max_diff(batched[seq][-1], alone[seq][0]) <= SELF_ATOL
    # A mixed step: decode rows for a, b, c and a fresh prefill for d, in one flat forward.
    d = prompt(9, 6)
    mixed = step(
        dec, att, {"a": [alone["a"][1]], "d": d, "b": [alone["b"][1]], "c": [alone["c"][1]]}
    )
    for seq in prompts:
        assert max_diff(mixed[seq][-1], alone[seq][2]) <= SELF_ATOL
    d_alone = step(dec, RefPagedAttention(dec), {"d": d})["d"]
    assert max_diff(mixed["d"], d_alone) <= SELF_ATOL


@pytest.mark.parametrize("chunks", [(7, 13), (6, 8, 6), (1, 19)])
def test_chunked_prefill_equals_one_forward(pair: Pair, chunks: tuple[int, ...]) -> None:
    dec = pair.decoder
    tokens = prompt(PROMPT_LEN, seed=9)
    whole = step(dec, RefPagedAttention(dec), {"a": tokens})["a"]
    att = RefPagedAttention(dec, seed=3)
    parts, start = [], 0
    for n in chunks:
        parts.append(step(dec, att, {"a": tokens[start : start + n]})["a"])
        start += n
    assert max_diff(torch.cat(parts), whole) <= SELF_ATOL


def test_positions_matter(pair: Pair) -> None:
    """Sensitivity: stretching the positions (x2) moves the logits far beyond HF_ATOL, so the
    parity checks above would catch a position or rotary mistake. (A uniform shift would not:
    rotary attention scores depend only on position differences; the test checks that too.)"""

    class Stretched(RefPagedAttention):
        @property
        def positions(self) -> torch.Tensor:
            return super().positions * 2

    class Shifted(RefPagedAttention):
        @property
        def positions(self) -> torch.Tensor:
            return super().positions + 5

    dec, tokens = pair.decoder, prompt(PROMPT_LEN, seed=10)
    ref = step(dec, RefPagedAttention(dec), {"a": tokens})["a"]
    stretched = step(dec, Stretched(dec), {"a": tokens})["a"]
    assert max_diff(ref, stretched) > 1000 * HF_ATOL
    shifted = step(dec, Shifted(dec), {"a": tokens})["a"]
    assert max_diff(ref, shifted) <= HF_ATOL


def test_bfloat16_close_to_transformers_bfloat16(pair: Pair) -> None:
    dec = PagedDecoder.from_checkpoint(pair.config, pair.state_dict, dtype=torch.bfloat16)
    assert dec.dtype == torch.bfloat16 and dec.attention_spec().dtype == torch.bfloat16
    tokens = prompt(PROMPT_LEN, seed=11)
    ours = step(dec, RefPagedAttention(dec), {"a": tokens})["a"]
    assert ours.dtype == torch.bfloat16
    ref = hf_logits(pair.hf.to(torch.bfloat16), tokens)
    pair.hf.to(torch.float32)
    assert max_diff(ours, ref) <= BF16_ATOL


# ---------------------------------------------------------------------------------- rope


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["default", "linear", "llama3-8k", "llama3-short"],
)
@pytest.mark.parametrize("head_dim", [16, 128])
def test_inv_freq_matches_transformers(rope: dict[str, Any], head_dim: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    heads = 4
    hf_cfg = transformers.LlamaConfig(
        **{**SMALL, "hidden_size": heads * head_dim, "num_attention_heads": heads},
        num_hidden_layers=1,
        rope_parameters=dict(rope),
    )
    ours = DecoderConfig.from_hf(hf_cfg.to_dict()).rope.inv_freq(head_dim)
    assert torch.equal(ours, LlamaRotaryEmbedding(hf_cfg).inv_freq)
    if rope["rope_type"] == "llama3":
        wavelen = 2 * math.pi / RopeConfig(theta=rope["rope_theta"]).inv_freq(head_dim)
        orig = rope["original_max_position_embeddings"]
        assert (wavelen < orig / rope["high_freq_factor"]).any()
        assert (wavelen > orig / rope["low_freq_factor"]).any()


# ---------------------------------------------------------------------------------- config


def llama_json(**over: Any) -> dict[str, Any]:
    base = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
    }
    base.update(over)
    return base


def test_from_hf_defaults_and_legacy_rope_format() -> None:
    cfg = DecoderConfig.from_hf(
        llama_json(
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
            eos_token_id=[7, 9],
            bos_token_id=1,
        )
    )
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 8
    assert cfg.rope == RopeConfig(theta=500000.0, rope_type="linear", factor=2.0)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.tie_word_embeddings) == (
        False,
        False,
        False,
        False,
    )
    assert cfg.eos_token_ids == (7, 9) and cfg.bos_token_id == 1
    plain = DecoderConfig.from_hf(llama_json(eos_token_id=2))
    assert plain.rope == RopeConfig() and plain.eos_token_ids == (2,)
    qwen = DecoderConfig.from_hf(llama_json(model_type="qwen2", rope_theta=1e6, head_dim=16))
    assert (qwen.qkv_bias, qwen.o_bias, qwen.head_dim, qwen.rope.theta) == (True, False, 16, 1e6)
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings.
    l3 = DecoderConfig.from_hf(
        llama_json(
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        )
    )
    assert l3.rope.original_max_position_embeddings == 4096 and l3.rope.theta == 10000.0


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"model_type": "mistral"}, ["mistral", "llama", "qwen2"]),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["yarn", "llama3", "linear"]),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["dynamic", "supported"]),
        ({"rope_parameters": {"rope_type": "linear"}}, ["factor"]),
        ({"hidden_act": "gelu"}, ["gelu", "silu"]),
        ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads"]),
        ({"vocab_size": 0}, ["vocab_size"]),
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, ["sliding"]),
    ],
)
def test_from_hf_rejects(over: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        DecoderConfig.from_hf(llama_json(**over))
    for word in words:
        assert word in str(info.value)


def test_from_checkpoint_lists_missing_and_unexpected_keys(pair: Pair) -> None:
    sd = dict(pair.state_dict)
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.9.extra.weight"] = torch.zeros(1)
    sd["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as info:
        PagedDecoder.from_checkpoint(pair.config, sd)
    msg = str(info.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.9.extra.weight" in msg
    assert "model.norm.weight" in msg


def test_tied_checkpoint_loads_without_lm_head(pair: Pair) -> None:
    dec = pair.decoder
    if not pair.config.get("tie_word_embeddings"):
        assert "lm_head.weight" in pair.state_dict
        sd = {k: v for k, v in pair.state_dict.items() if k != "lm_head.weight"}
        with pytest.raises(ValueError, match="lm_head.weight"):
            PagedDecoder.from_checkpoint(pair.config, sd)
        return
    assert "lm_head.weight" not in pair.state_dict
    assert dec.lm_head.weight is dec.model.embed_tokens.weight
    assert torch.equal(dec.lm_head.weight, pair.state_dict["model.embed_tokens.weight"])
    # A redundant lm_head.weight and an old rotary buffer are accepted and ignored.
    extra = {
        **pair.state_dict,
        "lm_head.weight": pair.state_dict["model.embed_tokens.weight"].clone(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    again = PagedDecoder.from_checkpoint(pair.config, extra, dtype=torch.bfloat16)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert again.lm_head.weight.dtype == torch.bfloat16


def test_random_is_seeded_and_leaves_global_rng_alone() -> None:
    cfg = DecoderConfig.from_hf(llama_json(num_key_value_heads=2, tie_word_embeddings=True))
    before = torch.get_rng_state()
    a, b = PagedDecoder.random(cfg, seed=3), PagedDecoder.random(cfg, seed=3)
    c = PagedDecoder.random(cfg, seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.lm_head.weight is a.model.embed_tokens.weight
    half = PagedDecoder.random(cfg, seed=3, dtype=torch.bfloat16)
    assert torch.equal(half.model.norm.weight, a.model.norm.weight.to(torch.bfloat16))
    spec = a.attention_spec()
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (
        8,
        2,
        8,
        torch.float32,
    )
    assert a.attention_spec(torch.bfloat16).dtype == torch.bfloat16
    # The random model runs end to end through the paged cache.
    out = step(a, RefPagedAttention(a), {"x": [1, 2, 3], "y": [4]})
    assert out["x"].shape == (3, 100) and torch.isfinite(out["x"]).all()


def test_forward_rejects_bad_inputs(pair: Pair) -> None:
    dec = pair.decoder
    att = RefPagedAttention(dec)
    att.plan({"a": 3})
    with pytest.raises(EngineError, match="positions"):
        dec(torch.tensor([1, 2]), att)
    with pytest.raises(EngineError, match="input_ids"):
        dec(torch.tensor([[1, 2, 3]]), att)
