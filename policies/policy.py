"""``ChunkPolicy``: the push/close contract every chunk policy shares, and argument checks.

A concrete policy only does index arithmetic: which spans ``[start, stop)`` are complete once
``n`` items have arrived, which spans ``close()`` flushes, and the oldest item it may still need.
Buffering, kind checks, the closed state, building chunks and the final chunk live here, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self, TypeAlias

import torch

from mstar_async.errors import PolicyError

from .buffer import ItemBuffer, Items, new_buffer
from .chunk import Chunk

Span: TypeAlias = tuple[int, int, int, int]
"""``(start, stop, context, lookahead)`` of one chunk, in stream indices and item counts."""


def check_int(
    owner: str, name: str, value: object, low: int, high: int | None = None, high_name: str = ""
) -> int:
    """Return ``value`` if it is an int in ``[low, high]`` (``high`` None: no upper bound).

    Pure, synchronous. Raises ``ValueError`` naming ``owner``, the argument and its allowed range
    otherwise; ``bool`` and ``float`` are rejected even when integral.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= low and (high is None or value <= high):
            return value
        got = repr(value)
    else:
        got = f"{value!r} ({type(value).__name__})"
    if high is None:
        allowed = f"an int >= {low}"
    else:
        bound = f"{high_name}={high}" if high_name else str(high)
        allowed = f"an int in [{low}, {bound}]"
    raise ValueError(f"{owner}: {name} must be {allowed}, got {got}")


class ChunkPolicy(ABC):
    """Cuts one stream into chunks; one instance per request per edge.

    Feed it with ``push(items)`` (a list, or a tensor whose dim 0 is the item axis; any count,
    including none) and finish with ``close()``. Each returns the chunks ready at that point,
    oldest first. For every policy, each chunk's ``data`` equals ``stream[start:end]``, the
    ``new`` parts of all chunks, in order, are the whole stream exactly once, and the last chunk,
    and only it, is ``final`` (``close()`` returns it even when nothing is left to deliver, so a
    consumer waiting for the end always sees it). A policy retains only the items it may still
    need, never the whole stream. Edges keep a template and call ``fresh()`` per request. Pure,
    synchronous; misuse raises ``PolicyError``.

    Pushed tensors are kept by reference until no longer needed: do not modify them in place
    after pushing (push a ``.clone()`` of a reused output buffer).

    A new policy subclasses this and implements ``params`` plus three index hooks, ``_ready``,
    ``_tail`` and ``_keep_from``; it never touches items itself.
    """

    __slots__ = ("_buffer", "_closed")

    def __init__(self) -> None:
        self._buffer: ItemBuffer | None = None
        self._closed = False

    @property
    @abstractmethod
    def params(self) -> dict[str, int]:
        """The constructor arguments, by name; ``type(p)(**p.params)`` is a fresh equal policy."""

    @abstractmethod
    def _ready(self, n: int) -> list[Span]:
        """Spans that became complete now that ``n`` items have arrived; advances the state."""

    @abstractmethod
    def _tail(self, n: int) -> list[Span]:
        """The spans ``close()`` flushes after ``n`` items, oldest first; the last one's new part
        ends at ``n`` with no look-ahead. Empty if every item was delivered."""

    @abstractmethod
    def _keep_from(self, n: int) -> int:
        """The oldest stream index a later chunk or ``close()`` may still need."""

    def push(self, items: Items) -> list[Chunk]:
        """Add ``items`` to the stream; return the chunks completed by them, oldest first.

        ``items`` is a list or a tensor with dim 0 as the item axis; it may be empty. The first
        non-empty push fixes the kind (and, for tensors, trailing shape, dtype and device); an
        empty list is accepted whatever the kind. Pure, synchronous. Raises ``PolicyError`` after
        ``close()``, for items of another kind, or for anything but a list or a tensor of dim >= 1;
        the policy is unchanged when it raises.
        """
        if self._closed:
            raise self._closed_error("push")
        buffer = self._buffer
        if buffer is None:
            if isinstance(items, list):
                if not items:
                    return []
            elif isinstance(items, torch.Tensor) and items.dim() >= 1 and items.shape[0] == 0:
                return []
            buffer = new_buffer(repr(self), items)
            self._buffer = buffer
        elif isinstance(items, list) and not items:
            return []
        if not buffer.append(items):
            return []
        n = buffer.end
        spans = self._ready(n)
        chunks = [Chunk(buffer.take(s, e), s, c, a) for s, e, c, a in spans] if spans else []
        buffer.release_before(self._keep_from(n))
        return chunks

    def close(self) -> list[Chunk]:
        """End the stream; return the undelivered tail's chunks, the last one ``final=True``.

        Always returns at least the final chunk: when every item was already delivered it has
        no new items and no data (``[]`` if nothing was ever pushed, else an empty slice of the
        stream's kind, at ``start`` = the stream's length). Releases all retained items. Pure,
        synchronous. Raises ``PolicyError`` if the policy is already closed.
        """
        if self._closed:
            raise self._closed_error("close")
        self._closed = True
        buffer = self._buffer
        if buffer is None:
            return [Chunk([], 0, final=True)]
        n = buffer.end
        spans = self._tail(n) or [(n, n, 0, 0)]
        last = len(spans) - 1
        chunks = [
            Chunk(buffer.take(s, e), s, c, a, final=i == last)
            for i, (s, e, c, a) in enumerate(spans)
        ]
        buffer.release_before(n)
        return chunks

    def fresh(self) -> Self:
        """A new, unused policy with the same parameters. Pure, synchronous; never raises."""
        return type(self)(**self.params)

    @property
    def buffered(self) -> int:
        """How many items the policy retains right now (read-only)."""
        return 0 if self._buffer is None else len(self._buffer)

    @property
    def pushed(self) -> int:
        """How many items have been pushed so far (the stream length up to now)."""
        return 0 if self._buffer is None else self._buffer.end

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def _closed_error(self, call: str) -> PolicyError:
        return PolicyError(
            f"{self!r}: {call}() after close(): policy already closed; "
            "create a fresh policy per stream with .fresh()"
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkPolicy):
            return NotImplemented
        return type(self) is type(other) and self.params == other.params

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.params.items())))
