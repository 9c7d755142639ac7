"""Tiny models, tokenizers, folders and GGUF files built in-process for the checkpoint tests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<custom>"  # a non-special added token (GGUF token type 4)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Exercises the environment rather than plain concatenation: bos/eos variables, whitespace
# control, loop controls, tojson without HTML escaping, and raise_exception.
FANCY_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == 'skip me' %}{% continue %}{% endif %}
    <{{ message['role'] }}> {{ message['content'] | tojson }}
    {% if not loop.last %}
---
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"""

TRAINING_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "héllo wörld, naïve café! 12345 apples and 678 pears.",
    "def main():\n    return 42\n",
    "It's what they're saying: we'll see, I'd think.",
] * 20


def digits_then_byte_level() -> Any:
    """The "smollm" pre-tokenizer: every digit alone, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def train_tokenizer(pre: str, vocab_size: int = 300) -> Tokenizer:
    """A small byte-level BPE: 256 byte tokens, the specials, ~40 merges, one user token."""
    tokenizer = Tokenizer(models.BPE())
    if pre == "smollm":
        tokenizer.pre_tokenizer = digits_then_byte_level()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    tokenizer.add_tokens([AddedToken(USER_TOKEN, special=False, normalized=False)])
    return tokenizer


def make_llama(vocab_size: int, *, tied: bool, seed: int = 0) -> Any:
    """A random 2-layer ``LlamaForCausalLM`` with GQA (4 heads, 2 kv heads, hidden 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # The default 0.02 init leaves attention almost uniform, which would hide a wrong q/k row
    # order; larger weights make the logits depend sharply on it.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def reference_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's HF->GGUF q/k row order, written index by index (independent of the library).

    Per head: GGUF row 2i <- HF row i, GGUF row 2i+1 <- HF row i + head_dim/2.
    """
    head_dim = weight.shape[0] // n_heads
    half = head_dim // 2
    order = []
    for head in range(n_heads):
        base = head * head_dim
        for i in range(half):
            order += [base + i, base + half + i]
    return weight[order].clone()


def _gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"


def write_gguf(
    path: Path,
    model: Any,
    tokenizer: Tokenizer,
    *,
    pre: str,
    chat_template: str,
    kinds: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """Write ``model`` + ``tokenizer`` as a Llama GGUF, as llama.cpp's converter would: every
    tensor F32, or the type ``kinds`` gives its GGUF name (quantized by ``gguf.quants``)."""
    config = model.config
    tied = bool(config.tie_word_embeddings)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)

    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t["content"]: t["special"] for t in spec["added_tokens"]}
    types = [
        (3 if specials[t] else 4) if t in specials else 1  # control / user-defined / normal
        for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)

    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            data = reference_permute(data, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = reference_permute(data, config.num_key_value_heads)
        values = np.ascontiguousarray(data.numpy())
        kind = (kinds or {}).get(_gguf_name(name), gguf.GGMLQuantizationType.F32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), values)
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hf_folder(
    folder: Path, model: Any, tokenizer: Tokenizer, *, chat_template: str, eos_ids: list[int]
) -> None:
    """Save ``model`` and ``tokenizer`` the way transformers does, then set generation eos ids."""
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    generation = {"bos_token_id": 1, "eos_token_id": eos_ids}
    (folder / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
