"""Item buffers: the retained tail of one stream, as a list or as pieces of a tensor.

A policy sees the stream in pushes of any size (often one item per decode step) and cuts it into
chunks at its own boundaries. The buffers here keep only the items the policy says it may still
need, addressed by *stream index*, so the policies can be written as pure index arithmetic.

Why they are built this way:

* Pushing must be O(items pushed). A tensor buffer therefore keeps the pushed tensors as separate
  pieces and calls ``torch.cat`` only when a chunk is formed; concatenating on every push would
  re-copy the whole retained tail per token, O(n * window) over a stream.
* Releasing must be O(1) amortised and must really free memory. Items are dropped by advancing a
  head offset; the backing list or first tensor piece is compacted only once the dropped prefix
  outweighs what is still live, so each item is copied O(1) times on average and no buffer pins
  more than about twice what it retains (a view into a large pushed tensor would otherwise keep
  the whole tensor alive).
* Chunk data is always new: a fresh list, or a fresh contiguous tensor from ``torch.cat``. Two
  chunks never share memory with each other or with the buffer, so a consumer may edit a chunk in
  place without corrupting the context of the next one.

Pushed tensors are held by reference until released (copying every push would cost a copy per
token); a producer that reuses one output tensor across steps must push a ``.clone()``.

Pure, synchronous.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any, TypeAlias

import torch

from mstar_async.errors import PolicyError

Items: TypeAlias = "list[Any] | torch.Tensor"
"""What a policy takes and a chunk carries: a list, or a tensor whose dim 0 is the item axis."""


def _describe_tensor(t: torch.Tensor) -> str:
    dims = ", ".join(["*", *(str(d) for d in t.shape[1:])])
    return f"a tensor of shape [{dims}] dtype {t.dtype} on {t.device}"


def kind_of(items: object) -> str:
    """Name the kind of ``items`` for error messages ("a list", "a tensor of shape [*, 3] ...")."""
    if isinstance(items, list):
        return "a list"
    if isinstance(items, torch.Tensor):
        if items.dim() == 0:
            return f"a 0-d tensor (dtype {items.dtype})"
        return _describe_tensor(items)
    return f"a {type(items).__name__}"


class ItemBuffer(ABC):
    """The retained items ``[start, end)`` of one stream; base of the list and tensor buffers.

    ``end`` counts every item ever appended; ``start`` is the stream index of the oldest retained
    item. Pure, synchronous; ``append`` raises ``PolicyError`` for items of another kind.
    """

    __slots__ = ("_end", "_owner", "_start")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._start = 0
        self._end = 0

    @property
    def start(self) -> int:
        """Stream index of the oldest retained item."""
        return self._start

    @property
    def end(self) -> int:
        """Number of items appended so far (the stream index one past the newest)."""
        return self._end

    def __len__(self) -> int:
        return self._end - self._start

    @abstractmethod
    def expected(self) -> str:
        """Describe the kind of items this buffer takes, for error messages."""

    @abstractmethod
    def append(self, items: Items) -> int:
        """Append ``items`` and return how many there were; ``PolicyError`` if of another kind."""

    @abstractmethod
    def take(self, start: int, stop: int) -> Items:
        """A new list / contiguous tensor of stream items ``[start, stop)``, all still retained
        (empty, of the stream's kind, when ``start == stop``)."""

    @abstractmethod
    def release_before(self, index: int) -> None:
        """Forget every item with stream index below ``index`` (a no-op if already forgotten)."""

    def _mismatch(self, items: object) -> PolicyError:
        return PolicyError(
            f"{self._owner}: expected {self.expected()} (fixed by the first non-empty push), "
            f"got {kind_of(items)}"
        )


class ListBuffer(ItemBuffer):
    """Retained items of a stream pushed as Python lists. Pure, synchronous."""

    __slots__ = ("_head", "_items")

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self._items: list[Any] = []
        self._head = 0  # index in _items of stream item _start

    def expected(self) -> str:
        return "a list"

    def append(self, items: Items) -> int:
        if not isinstance(items, list):
            raise self._mismatch(items)
        self._items.extend(items)
        self._end += len(items)
        return len(items)

    def take(self, start: int, stop: int) -> list[Any]:
        offset = self._head - self._start
        return self._items[start + offset : stop + offset]

    def release_before(self, index: int) -> None:
        drop = min(index, self._end) - self._start
        if drop <= 0:
            return
        self._head += drop
        self._start += drop
        # Compact only once the dead prefix is larger than the live part: amortised O(1) per item.
        if self._head > len(self._items) - self._head:
            del self._items[: self._head]
            self._head = 0


class TensorBuffer(ItemBuffer):
    """Retained items of a stream pushed as tensors (dim 0 = items). Pure, synchronous.

    The first tensor fixes the trailing shape, dtype and device; ``append`` raises ``PolicyError``
    for a list, a 0-d tensor, or a tensor that differs in any of those (even an empty one).
    """

    __slots__ = ("_device", "_dtype", "_head", "_pieces", "_sizes", "_trailing")

    def __init__(self, owner: str, like: torch.Tensor) -> None:
        super().__init__(owner)
        self._trailing = like.shape[1:]
        self._dtype = like.dtype
        self._device = like.device
        self._pieces: deque[torch.Tensor] = deque()
        self._sizes: deque[int] = deque()  # len of each piece; cheaper than asking the tensor
        self._head = 0  # offset in _pieces[0] of stream item _start

    def expected(self) -> str:
        dims = ", ".join(["*", *(str(d) for d in self._trailing)])
        return f"a tensor of shape [{dims}] dtype {self._dtype} on {self._device}"

    def append(self, items: Items) -> int:
        if (
            not isinstance(items, torch.Tensor)
            or items.dim() == 0
            or items.shape[1:] != self._trailing
            or items.dtype != self._dtype
            or items.device != self._device
        ):
            raise self._mismatch(items)
        count = items.shape[0]
        if count:
            self._pieces.append(items)
            self._sizes.append(count)
            self._end += count
        return count

    def take(self, start: int, stop: int) -> torch.Tensor:
        if start >= stop:
            return torch.empty((0, *self._trailing), dtype=self._dtype, device=self._device)
        parts: list[torch.Tensor] = []
        pos = self._start - self._head  # stream index of _pieces[0][0]
        for piece, count in zip(self._pieces, self._sizes, strict=True):
            if pos >= stop:
                break
            end = pos + count
            if end > start:
                # Slicing costs microseconds per piece; pass whole pieces as they are.
                if pos >= start and end <= stop:
                    parts.append(piece)
                else:
                    parts.append(piece[max(start - pos, 0) : min(stop, end) - pos])
            pos = end
        # cat always allocates, even for one part, so chunks never alias the buffer or each other.
        return torch.cat(parts, dim=0)

    def release_before(self, index: int) -> None:
        drop = min(index, self._end) - self._start
        if drop <= 0:
            return
        self._start += drop
        pieces, sizes = self._pieces, self._sizes
        head = self._head + drop
        while sizes and head >= sizes[0]:
            head -= sizes.popleft()
            pieces.popleft()
        if head and head > sizes[0] - head:
            # The dead prefix outweighs the live rest: copy the rest so the old storage can go.
            pieces[0] = pieces[0][head:].clone(memory_format=torch.contiguous_format)
            sizes[0] -= head
            head = 0
        self._head = head


def new_buffer(owner: str, items: Items) -> ItemBuffer:
    """A buffer of the kind of ``items`` (a non-empty list or tensor with dim >= 1).

    ``owner`` prefixes error messages. Pure, synchronous; raises ``PolicyError`` for anything
    that is neither a list nor a tensor with at least one dimension.
    """
    if isinstance(items, list):
        return ListBuffer(owner)
    if isinstance(items, torch.Tensor) and items.dim() >= 1:
        return TensorBuffer(owner, items)
    raise PolicyError(
        f"{owner}: push takes a list of items or a tensor whose dim 0 is the item axis, "
        f"got {kind_of(items)}"
    )
