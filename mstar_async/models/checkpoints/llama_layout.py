"""How a Llama checkpoint's tensors are named and laid out in GGUF versus Hugging Face.

Two differences matter. Names: GGUF says ``blk.3.attn_q.weight`` where Hugging Face says
``model.layers.3.self_attn.q_proj.weight``. Rows of q_proj / k_proj: Hugging Face Llama applies
rotary embeddings "rotate-half" style, pairing dimension ``i`` of a head with ``i + head_dim/2``,
while llama.cpp's Llama kernel pairs adjacent dimensions ``2i`` and ``2i + 1``. llama.cpp's
HF->GGUF converter therefore reorders each head's rows so that row ``2i`` holds HF row ``i`` and
row ``2i + 1`` holds HF row ``i + head_dim/2``. Importing must undo that, or attention scores come
out wrong (the model still runs, it just talks nonsense).
"""

from __future__ import annotations

import re

import torch

from mstar_async.models.checkpoints.errors import CheckpointError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` parameter name for GGUF tensor ``gguf_name``.

    Raises ``CheckpointError`` for a tensor a plain Llama model does not have (biases,
    ``rope_freqs``, ...), since dropping it silently would change the model.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _GGUF_BLOCK.fullmatch(gguf_name)
    if match is not None and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.weight"
    raise CheckpointError(
        f"GGUF tensor {gguf_name!r} has no counterpart in a plain Llama model; "
        "this importer handles Llama checkpoints without biases or rope scaling tensors"
    )


def gguf_name(hf: str) -> str:
    """The GGUF tensor name for Hugging Face Llama parameter ``hf`` (inverse of ``hf_name``).

    Raises ``CheckpointError`` for a name outside the plain Llama layout.
    """
    for gguf, name in _GLOBAL_NAMES.items():
        if name == hf:
            return gguf
    match = _HF_BLOCK.fullmatch(hf)
    if match is not None:
        for gguf, name in _BLOCK_NAMES.items():
            if name == match.group(2):
                return f"blk.{match.group(1)}.{gguf}.weight"
    raise CheckpointError(f"{hf!r} is not a parameter of a plain Llama model")


def is_rope_projection(hf: str) -> bool:
    """Whether ``hf`` names a q_proj or k_proj weight, whose rows GGUF stores reordered."""
    return hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))


def _split_heads(weight: torch.Tensor, n_heads: int) -> int:
    rows = weight.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads) != 0:
        raise CheckpointError(
            f"a projection with {rows} rows cannot be split into {n_heads} heads of even size"
        )
    return rows // n_heads


def interleave_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from Hugging Face layout to llama.cpp's (what its converter does).

    Within each of the ``n_heads`` heads, output row ``2i`` is input row ``i`` and output row
    ``2i + 1`` is input row ``i + head_dim/2``. Raises ``CheckpointError`` if the rows do not
    split into ``n_heads`` even-sized heads.
    """
    head_dim = _split_heads(weight, n_heads)
    halves = weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape).contiguous()


def deinterleave_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo ``interleave_rope_rows``: llama.cpp q/k row order back to Hugging Face's.

    Within each head, output row ``i`` is input row ``2i`` and output row ``i + head_dim/2`` is
    input row ``2i + 1``. Raises ``CheckpointError`` if the rows do not split into ``n_heads``
    even-sized heads.
    """
    head_dim = _split_heads(weight, n_heads)
    pairs = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()
