"""``Chunk``: one piece of a stream cut by a chunk policy, with where it sits in the stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffer import Items


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """Stream items ``[start, start + len(data))``: left context, the new items, look-ahead.

    ``data`` is a new list for list streams, a new contiguous tensor (dim 0 = items) for tensor
    streams. ``context`` counts the leading items of ``data`` already delivered in an earlier
    chunk; ``lookahead`` counts the trailing items that follow the new ones and will be new in a
    later chunk (right context for a consumer whose output for an item depends on the items
    after it). So ``data[context:len(data) - lookahead]`` is what is new. ``final`` marks the
    last chunk of the stream, which ``close()`` always returns; it may have no new items (and
    then no data: ``[]`` for a stream that carried nothing, else an empty slice of its kind).

    Equality compares positions, flags and contents (tensors with ``torch.equal``, same dtype
    and shape). Pure, synchronous; the constructor raises ``ValueError`` if ``start < 0``, or
    ``context`` or ``lookahead`` is negative, or together they exceed ``len(data)``.
    """

    data: Items
    start: int
    context: int = 0
    lookahead: int = 0
    final: bool = False

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"Chunk: start must be >= 0, got {self.start}")
        if self.context < 0 or self.lookahead < 0 or self.context + self.lookahead > len(self.data):
            raise ValueError(
                f"Chunk: context and lookahead must be >= 0 with context + lookahead <= "
                f"len(data)={len(self.data)}, got {self.context} and {self.lookahead}"
            )

    @property
    def new(self) -> Items:
        """The items delivered for the first time: ``data[context:len(data) - lookahead]`` (a
        view for tensors)."""
        return self.data[self.context : len(self.data) - self.lookahead]

    @property
    def end(self) -> int:
        """Stream index one past the last item: ``start + len(data)``."""
        return self.start + len(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Chunk):
            return NotImplemented
        mine = (self.start, self.context, self.lookahead, self.final)
        if mine != (other.start, other.context, other.lookahead, other.final):
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
            f"lookahead={self.lookahead}, final={self.final}, data={shown})"
        )
