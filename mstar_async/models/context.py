"""The context limit of a zoo language model, worked out without building its engine.

A request's sequence can hold no more tokens than the decoder has positions, nor more than its
whole KV cache: ``KVCacheEngine`` sizes that cache from ``kv_cache_bytes`` the same way
(``capacity_tokens``), so the builder knows the limit before any weights load.
"""

from __future__ import annotations

import torch

from mstar_async.engines.kv.cache import capacity_tokens
from mstar_async.models.llama import DecoderConfig


def decoder_context(config: DecoderConfig, *, dtype: torch.dtype, kv_cache_bytes: int) -> int:
    """The most tokens one sequence of a ``KVCacheEngine`` over this decoder can hold.

    Raises:
        ValueError: ``kv_cache_bytes`` fits no KV block.
    """
    kv_tokens = capacity_tokens(
        config.attention_spec(dtype),
        num_layers=config.num_hidden_layers,
        kv_cache_bytes=kv_cache_bytes,
    )
    return min(config.max_position_embeddings, kv_tokens)
