"""Paged K/V storage: one tensor holding every layer's key and value blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mstar_async.errors import EngineError

from .allocator import PagedKVAllocator
from .sizing import blocks_for_budget

if TYPE_CHECKING:
    from .attention import AttentionSpec

__all__ = ["DEFAULT_BLOCK_SIZE", "PagedKVCache", "capacity_tokens", "paged_storage"]

#: Tokens per KV block of the engines that take no ``block_size``.
DEFAULT_BLOCK_SIZE = 16


class PagedKVCache:
    """Key and value blocks for every layer, addressed by flat slot ``block * block_size + off``.

    Why one tensor of shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
    rather than two tensors per layer: it is a single allocation, so its size is exactly what
    the byte budget paid for and it cannot fragment; a copy-on-write copy moves a block for all
    layers, K and V at once, in one indexed copy instead of ``2 * num_layers`` small ones; and
    :meth:`key` / :meth:`value` are still contiguous ``[num_blocks, block_size, kv_heads,
    head_dim]`` views (FlashInfer's NHD layout) because only leading axes are indexed.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        """Allocate a zero-filled cache.

        Raises:
            ValueError: a size is not a positive int.
        """
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """Allocate as many blocks as fit in ``budget_bytes``.

        Raises:
            ValueError: the budget fits no block, or a size is not a positive int.
        """
        num_blocks = blocks_for_budget(
            budget_bytes,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        )
        return cls(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stored K and V."""
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        """Device the cache lives on."""
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Bytes the cache occupies."""
        return self.kv.numel() * self.kv.element_size()

    def key(self, layer: int) -> torch.Tensor:
        """Return layer ``layer``'s key blocks, ``[num_blocks, block_size, kv_heads, head_dim]``.

        Raises:
            EngineError: ``layer`` is out of range.
        """
        return self.kv[self._layer(layer), 0]

    def value(self, layer: int) -> torch.Tensor:
        """Return layer ``layer``'s value blocks, ``[num_blocks, block_size, kv_heads, head_dim]``.

        Raises:
            EngineError: ``layer`` is out of range.
        """
        return self.kv[self._layer(layer), 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` (``[n, kv_heads, head_dim]``) at flat ``slots`` (``[n]`` int64).

        ``k`` and ``v`` are cast to the cache dtype. Slots must be distinct.

        Raises:
            EngineError: ``layer`` out of range, or shapes, slot dtype or device do not match.
        """
        li = self._layer(layer)
        n = slots.shape[0] if slots.dim() == 1 else -1
        want = (n, self.num_kv_heads, self.head_dim)
        if slots.dim() != 1 or tuple(k.shape) != want or tuple(v.shape) != want:
            raise EngineError(
                f"write expects slots [n] and k, v [n, {self.num_kv_heads}, {self.head_dim}], "
                f"got slots {tuple(slots.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if slots.dtype != torch.int64:
            raise EngineError(f"slots must be int64, got {slots.dtype}")
        if slots.device != self.device:
            raise EngineError(f"slots on {slots.device}, cache on {self.device}")
        flat = self.kv[li].view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, k.to(self.dtype))
        flat[1].index_copy_(0, slots, v.to(self.dtype))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` for every layer, K and V (copy-on-write).

        Sources are read before any destination is written.

        Raises:
            EngineError: a block id is out of range, or a destination repeats or is also a
                source.
        """
        if not pairs:
            return
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        for block in (*src, *dst):
            if not 0 <= block < self.num_blocks:
                raise EngineError(f"block id {block} out of range 0..{self.num_blocks - 1}")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise EngineError(f"copy destinations must be distinct fresh blocks, got {pairs}")
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        self.kv.index_copy_(2, dst_t, self.kv.index_select(2, src_t))

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise EngineError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return layer


def paged_storage(
    spec: AttentionSpec,
    *,
    num_layers: int,
    kv_cache_bytes: int | None,
    num_blocks: int | None,
    block_size: int,
    device: torch.device,
    owner: str,
) -> tuple[PagedKVAllocator, PagedKVCache]:
    """The block allocator and K/V storage of an engine, sized by exactly one of
    ``kv_cache_bytes`` (as many blocks as fit) and ``num_blocks``.

    Raises:
        ValueError: both or neither size given (the message names ``owner``), or the budget
            fits no block.
    """
    if (kv_cache_bytes is None) == (num_blocks is None):
        raise ValueError(f"{owner}: give exactly one of kv_cache_bytes and num_blocks")
    if num_blocks is None:
        assert kv_cache_bytes is not None
        num_blocks = _budget_blocks(spec, num_layers, kv_cache_bytes, block_size)
    cache = PagedKVCache(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        device=device,
    )
    return PagedKVAllocator(num_blocks, block_size), cache


def capacity_tokens(
    spec: AttentionSpec,
    *,
    num_layers: int,
    kv_cache_bytes: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> int:
    """The tokens a cache sized by ``kv_cache_bytes`` holds in all (as ``paged_storage`` sizes
    it): no one sequence can ever grow past it, so a request that needs more can never run.
    Pure arithmetic: nothing is allocated.

    Raises:
        ValueError: the budget fits no block, or a size is not a positive int.
    """
    return _budget_blocks(spec, num_layers, kv_cache_bytes, block_size) * block_size


def _budget_blocks(spec: AttentionSpec, num_layers: int, budget: int, block_size: int) -> int:
    return blocks_for_budget(
        budget,
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=block_size,
        dtype_bytes=torch.finfo(spec.dtype).bits // 8,
    )
