"""How many KV-cache blocks fit in a byte budget (pure arithmetic, no torch)."""

from __future__ import annotations

__all__ = ["blocks_for_budget", "bytes_per_block"]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def bytes_per_block(
    *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Return the bytes one block takes across all layers, K and V both counted.

    Raises:
        ValueError: an argument is not a positive int (the message names it).
    """
    return (
        2
        * _positive("num_layers", num_layers)
        * _positive("block_size", block_size)
        * _positive("num_kv_heads", num_kv_heads)
        * _positive("head_dim", head_dim)
        * _positive("dtype_bytes", dtype_bytes)
    )


def blocks_for_budget(
    budget_bytes: int,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype_bytes: int,
) -> int:
    """Return how many whole blocks fit in ``budget_bytes`` (K and V, every layer).

    Raises:
        ValueError: ``budget_bytes`` is not a non-negative int, or is too small for one block
            (the message names the budget and the bytes one block needs), or another argument
            is not a positive int.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    per_block = bytes_per_block(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype_bytes=dtype_bytes,
    )
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes fits no block: one block needs {per_block} bytes "
            f"({num_layers} layers x K,V x {block_size} tokens x {num_kv_heads} heads x "
            f"{head_dim} dims x {dtype_bytes} bytes)"
        )
    return n
