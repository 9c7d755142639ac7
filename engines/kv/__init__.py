"""Paged KV cache: block bookkeeping, K/V storage, and paged attention backends.

Pure bookkeeping (no torch): :class:`BlockPool`, :class:`PagedKVAllocator`, :class:`AppendPlan`,
:class:`BatchLayout`, :func:`blocks_for_budget`. Importing this package imports only those; the
torch-backed names (:class:`PagedKVCache`, the attention backends) load on first use.

One engine step, in order::

    plans = allocator.append_batch({seq: n_new, ...})     # KVCacheFull -> nothing changed
    cache.copy_blocks([c for p in plans for c in p.copies])  # CoW copies before any write
    layout = BatchLayout.from_plans(allocator, plans)
    meta = backend.plan(layout)                            # once per step
    for layer in range(num_layers):
        q, k, v = ...                                      # rotary uses meta.positions
        cache.write(layer, meta.slot_mapping, k, v)
        out = backend.forward(q, cache.key(layer), cache.value(layer), meta)
    allocator.free(seq)                                    # on finish, error and cancel alike
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .allocator import AppendPlan, PagedKVAllocator
from .batch import BatchLayout
from .block_pool import BlockPool
from .sizing import blocks_for_budget, bytes_per_block

if TYPE_CHECKING:
    from .attention import (
        AttentionBackend,
        AttentionMetadata,
        AttentionSpec,
        select_attention_backend,
    )
    from .cache import PagedKVCache
    from .flashinfer_backend import (
        FlashInferAttentionBackend,
        FlashInferAttentionMetadata,
        flashinfer_unsupported_reason,
    )
    from .torch_backend import TorchAttentionBackend, TorchAttentionMetadata

_LAZY = {
    "AttentionBackend": "attention",
    "AttentionMetadata": "attention",
    "AttentionSpec": "attention",
    "select_attention_backend": "attention",
    "PagedKVCache": "cache",
    "FlashInferAttentionBackend": "flashinfer_backend",
    "FlashInferAttentionMetadata": "flashinfer_backend",
    "flashinfer_unsupported_reason": "flashinfer_backend",
    "TorchAttentionBackend": "torch_backend",
    "TorchAttentionMetadata": "torch_backend",
}

__all__ = [
    "AppendPlan",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "BatchLayout",
    "BlockPool",
    "FlashInferAttentionBackend",
    "FlashInferAttentionMetadata",
    "PagedKVAllocator",
    "PagedKVCache",
    "TorchAttentionBackend",
    "TorchAttentionMetadata",
    "blocks_for_budget",
    "bytes_per_block",
    "flashinfer_unsupported_reason",
    "select_attention_backend",
]


def __getattr__(name: str) -> Any:
    """Load a torch-backed name on first use.

    Raises:
        AttributeError: ``name`` is not exported by this package.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
