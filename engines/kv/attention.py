"""The paged-attention backend interface, its per-batch metadata, and backend selection.

A step drives a backend like this (see ``engines/kv/__init__.py`` for the whole loop)::

    meta = backend.plan(layout)               # once per batch: device tensors, kernel plans
    for layer in range(num_layers):
        cache.write(layer, meta.slot_mapping, k, v)        # this step's K/V first
        out = backend.forward(q, cache.key(layer), cache.value(layer), meta)

``q`` holds every sequence's query tokens flat in batch order, ``[num_tokens, num_heads,
head_dim]``; the output has the same shape. Query ``j`` of a sequence with context length ``L``
and query length ``Q`` attends causally to keys ``0 .. L - Q + j`` through its block table.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from mstar_async.errors import EngineError

from .batch import BatchLayout

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "select_attention_backend",
]


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Shape and numerics of one model's attention layers (shared by all its layers).

    Attributes:
        num_heads: query heads; a multiple of ``num_kv_heads`` (grouped-query attention).
        num_kv_heads: key/value heads stored in the cache.
        head_dim: dimension of each head.
        dtype: dtype of ``q`` and of the cache.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    scale: float | None = None

    def __post_init__(self) -> None:
        """Check the head counts.

        Raises:
            ValueError: a count is not positive, or ``num_heads`` is not a multiple of
                ``num_kv_heads``.
        """
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """The scale actually used: ``scale`` or ``1 / sqrt(head_dim)``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Per-batch tensors shared by every layer; made by :meth:`AttentionBackend.plan`.

    Attributes:
        layout: the batch this was planned for.
        slot_mapping: ``[num_tokens]`` int64 flat slot of each query token (for
            :meth:`PagedKVCache.write`), on the backend's device.
        positions: ``[num_tokens]`` int64 position of each query token in its sequence.
    """

    layout: BatchLayout
    slot_mapping: torch.Tensor
    positions: torch.Tensor


class AttentionBackend(ABC):
    """Paged attention over a mixed batch of prefill, chunked-prefill and decode sequences.

    A backend is planned once per batch and then called once per layer. It is not
    thread-safe: plan and run one batch at a time.
    """

    name: str = "abstract"

    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        """Bind the backend to a model's attention shape and a device."""
        self.spec = spec
        self.device = torch.device(device)

    @abstractmethod
    def plan(self, layout: BatchLayout) -> AttentionMetadata:
        """Build the metadata for one batch (call once per step, before any layer).

        Raises:
            EngineError: the layout does not suit this backend.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend ``q`` (``[num_tokens, num_heads, head_dim]``) to the paged cache of one layer.

        ``k_cache`` / ``v_cache`` are that layer's ``[num_blocks, block_size, num_kv_heads,
        head_dim]`` blocks with this step's tokens already written. Returns a tensor shaped
        like ``q``.

        Raises:
            EngineError: shapes, dtype or metadata do not match the plan.
        """

    def _base_tensors(self, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor(layout.slot_mapping, dtype=torch.int64, device=self.device)
        positions = torch.tensor(layout.positions(), dtype=torch.int64, device=self.device)
        return slots, positions

    def _check_forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout
    ) -> None:
        spec = self.spec
        want_q = (layout.num_query_tokens, spec.num_heads, spec.head_dim)
        if tuple(q.shape) != want_q:
            raise EngineError(f"q has shape {tuple(q.shape)}, the plan expects {want_q}")
        if q.dtype != spec.dtype:
            raise EngineError(f"q has dtype {q.dtype}, the backend was built for {spec.dtype}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (
                cache.dim() != 4
                or cache.shape[1] != layout.block_size
                or cache.shape[2:] != (spec.num_kv_heads, spec.head_dim)
            ):
                raise EngineError(
                    f"{name} has shape {tuple(cache.shape)}, expected [num_blocks, "
                    f"{layout.block_size}, {spec.num_kv_heads}, {spec.head_dim}]"
                )
            if not cache.is_contiguous():
                raise EngineError(f"{name} must be contiguous")
            if cache.dtype != spec.dtype:
                raise EngineError(f"{name} has dtype {cache.dtype}, expected {spec.dtype}")
            if cache.device != q.device:
                raise EngineError(f"{name} is on {cache.device}, q on {q.device}")


def select_attention_backend(
    device: torch.device | str,
    spec: AttentionSpec,
    *,
    prefer: Literal["auto", "torch", "flashinfer"] = "auto",
) -> AttentionBackend:
    """Return the best backend for ``device``: FlashInfer on CUDA when it imports and supports
    ``spec``, else the portable torch backend.

    Raises:
        EngineError: ``prefer="flashinfer"`` but FlashInfer cannot serve this device or spec.
    """
    from .flashinfer_backend import FlashInferAttentionBackend, flashinfer_unsupported_reason
    from .torch_backend import TorchAttentionBackend

    dev = torch.device(device)
    if prefer == "torch":
        return TorchAttentionBackend(spec, dev)
    reason = flashinfer_unsupported_reason(dev, spec)
    if reason is None:
        return FlashInferAttentionBackend(spec, dev)
    if prefer == "flashinfer":
        raise EngineError(f"FlashInfer backend unavailable: {reason}")
    return TorchAttentionBackend(spec, dev)
