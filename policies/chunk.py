"""``Chunk``: one piece of a stream cut by a chunk policy, with where it sits in the stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffer import Items


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """Stream items ``[start, start + len(data))``, the first ``context`` of them seen before.

    ``data`` is a new list for list streams, a new contiguous tensor (dim 0 = items) for tensor
    streams. ``context`` counts the leading items of ``data`` already delivered in an earlier
    chunk (left context for the consumer), so ``data[context:]`` is what is new. ``final`` is true
    only on the last chunk ``close()`` returns. Equality compares positions, flags and contents
    (tensors with ``torch.equal``, same dtype and shape). Pure, synchronous; the constructor
    raises ``ValueError`` if ``start < 0`` or ``context`` is outside ``[0, len(data)]``.
    """

    data: Items
    start: int
    context: int = 0
    final: bool = False

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"Chunk: start must be >= 0, got {self.start}")
        if not 0 <= self.context <= len(self.data):
            raise ValueError(
                f"Chunk: context must be in [0, len(data)={len(self.data)}], got {self.context}"
            )

    @property
    def new(self) -> Items:
        """The items delivered for the first time: ``data[context:]`` (a view for tensors)."""
        return self.data[self.context :]

    @property
    def end(self) -> int:
        """Stream index one past the last item: ``start + len(data)``."""
        return self.start + len(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Chunk):
            return NotImplemented
        if (self.start, self.context, self.final) != (other.start, other.context, other.final):
            return False
        a, b = self.data, other.data
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return (
                a.dtype == b.dtype
                and a.shape == b.shape
                and a.device == b.device
                and torch.equal(a, b)
            )
        if isinstance(a, list) and isinstance(b, list):
            return a == b
        return False

    def __repr__(self) -> str:
        data = self.data
        if isinstance(data, torch.Tensor):
            shown = f"<tensor {list(data.shape)} {data.dtype}>"
        elif len(data) <= 8:
            shown = repr(data)
        else:
            shown = f"<list of {len(data)} items>"
        return (
            f"Chunk(start={self.start}, end={self.end}, context={self.context}, "
            f"final={self.final}, data={shown})"
        )
