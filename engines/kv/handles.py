"""KV sequences kept under names beyond the requests that computed them, for every paged-KV
engine: a conversation kept between its turns (``retain``, then ``resume``), a named prefix
many requests fork from, and the one rule that maps a new prompt onto what a handle keeps.

A handle's sequence lives in the engine's allocator under ``HandleKey(name)`` (no request owns
it), with one key per kept token saying what that token *is* (``prefill_rows.prompt_keys``).
What a new prompt may take from a handle is the longest prefix its keys share with the
handle's (``shared``): a turn that continues the conversation takes all of it, and one that
departs earlier (an edited or truncated item) takes what comes before the departure.
A resumed prefill forks the handle's shared tokens (of several handles named, the one sharing
the most: ``longest``); ``rewind`` cuts the handle itself back to them, freeing its blocks past
the departure at once.

Bookkeeping over :class:`PagedKVAllocator` (no tensor is read or written); not thread-safe:
call it between an engine's forwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from mstar_async.engines.base import Step
from mstar_async.engines.sampling import SamplingParams
from mstar_async.errors import EngineError

from .allocator import PagedKVAllocator
from .prefill_rows import common_prefix
from .sequences import Handle, HandleKey

__all__ = ["HandleStore"]

SESSION = "session"
PREFIX = "prefix"


class HandleStore:
    """The handles of one engine's allocator, and what requests asked to keep under them.

    Kinds: ``"session"`` handles are freed only by ``drop``; ``"prefix"`` ones (named prefixes,
    and conversations kept ``evictable``) also by ``evict_lru``, least recently used first.
    """

    def __init__(self, allocator: PagedKVAllocator) -> None:
        self.allocator = allocator
        self._handles: dict[str, Handle] = {}
        # request -> its sequence -> (handle, kind) to keep when the request is released
        self._retained: dict[str, dict[Hashable, tuple[str, str]]] = {}
        self._uses = 0

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def get(self, name: str) -> Handle | None:
        """The handle ``name``, or None."""
        return self._handles.get(name)

    def summary(self) -> dict[str, tuple[str, int, int]]:
        """Every handle -> (kind, tokens, blocks it holds)."""
        alloc = self.allocator
        return {
            name: (
                h.kind,
                alloc.num_tokens(HandleKey(name)),
                len(alloc.block_table(HandleKey(name))),
            )
            for name, h in self._handles.items()
        }

    @property
    def kept_blocks(self) -> int:
        """Distinct blocks the handles hold (some may be shared with live sequences too)."""
        alloc = self.allocator
        return len({b for name in self._handles for b in alloc.block_table(HandleKey(name))})

    def touch(self, handle: Handle) -> None:
        """A use of ``handle`` (a hit, a creation, a resume): the LRU order."""
        self._uses += 1
        handle.used = self._uses

    def drop(self, name: str) -> bool:
        """Free ``name``'s reference to its blocks (those still shared with live forks stay
        until the forks end); return whether it existed. Never raises."""
        if self._handles.pop(name, None) is None:
            return False
        self.allocator.free(HandleKey(name))
        return True

    def forget(self, name: str) -> bool:
        """``drop`` ``name``, and withdraw every request's wish to keep a sequence under it when
        released, so a request in flight as its handle goes keeps nothing after (a deleted
        voice, an ended conversation); return whether the handle existed. Never raises."""
        for request_id in list(self._retained):
            wanted = self._retained[request_id]
            for seq in [seq for seq, (kept, _) in wanted.items() if kept == name]:
                del wanted[seq]
            if not wanted:
                del self._retained[request_id]
        return self.drop(name)

    def evict_lru(self) -> bool:
        """Drop the least recently used evictable handle; return whether there was one."""
        prefixes = [(h.used, name) for name, h in self._handles.items() if h.kind == PREFIX]
        if not prefixes:
            return False
        return self.drop(min(prefixes)[1])

    def keep(
        self,
        name: str,
        source: Hashable,
        kind: str,
        params: SamplingParams,
        keys: Sequence[Hashable],
        *,
        tokens: int | None = None,
        row_out: dict[int, torch.Tensor] | None = None,
    ) -> Handle:
        """Keep live sequence ``source`` (its first ``tokens``, all if None) under ``name``,
        replacing any handle of that name: a fork, so no memory is taken. ``keys`` are those of
        its kept tokens; ``row_out`` what the model reported at row positions among them.

        Raises:
            EngineError: ``source`` is not a live sequence, or ``tokens`` is past its length.
        """
        self.drop(name)
        key = HandleKey(name)
        self.allocator.fork(source, key)
        if tokens is not None:
            self.allocator.truncate(key, tokens)
        handle = Handle(kind, params, 0, list(keys))
        handle.row_out = {p: row for p, row in (row_out or {}).items() if p < len(handle.keys)}
        self._handles[name] = handle
        self.touch(handle)
        return handle

    def bookkeeping(self, step: Step, seq: Hashable) -> dict[str, Any] | EngineError | str:
        """A handle op's part that is the same in every engine: its ``handle`` input checked
        (an ``EngineError`` naming the step if missing), ``drop`` and ``retain`` (of ``seq``,
        ``evictable`` for a prefix kind) done here and their result returned; for any other op
        the handle's name, for the engine to act on. Never raises."""
        name = step.inputs.get("handle")
        if not isinstance(name, str) or not name:
            return EngineError(f"request {step.request_id}: {step.op} needs handle=<a name>")
        if step.op == "drop":
            return {"dropped": self.forget(name)}
        if step.op == "retain":
            kind = PREFIX if step.inputs.get("evictable") else SESSION
            self.retain(step.request_id, seq, name, kind)
            return {}
        return name

    def retain(self, request_id: str, seq: Hashable, name: str, kind: str) -> None:
        """Keep ``seq`` under ``name`` when ``request_id`` is released (see ``released``)."""
        self._retained.setdefault(request_id, {})[seq] = (name, kind)

    def retains(self, request_id: str) -> bool:
        """Whether ``request_id`` asked to keep a sequence when it is released."""
        return request_id in self._retained

    def released(self, request_id: str) -> dict[Hashable, tuple[str, str]]:
        """What ``request_id`` retained (sequence -> (handle, kind)), forgotten here."""
        return self._retained.pop(request_id, {})

    def shared(self, name: str, keys: Sequence[Hashable]) -> int:
        """How many leading tokens of a prompt with ``keys`` handle ``name`` holds: the longest
        prefix their keys share (0 for an unknown handle). The one rule for how a kept
        conversation maps onto a new one, used by ``resume`` and ``rewind`` alike."""
        handle = self._handles.get(name)
        return 0 if handle is None else common_prefix(handle.keys, keys)

    def longest(self, names: object, keys: Sequence[Hashable]) -> tuple[str, int]:
        """Of the handles ``names`` (a ``resume`` input: one name or a sequence of them), the
        one holding the longest prefix of a prompt with ``keys`` (the first named on a tie),
        and that length by ``shared``; ``("", 0)`` when none holds any of it."""
        best = ("", 0)
        for name in _resume_names(names):
            shared = self.shared(name, keys)
            if shared > best[1]:
                best = (name, shared)
        return best

    def fork(self, name: str, target: Hashable, tokens: int | None = None) -> Handle:
        """Start the sequence ``target`` as handle ``name``'s first ``tokens`` (all if None;
        ``shared`` says how many a prompt may take): a fork, truncated, so no memory is taken
        but a copy-on-write block on its next append. A use of the handle.

        Raises:
            EngineError: an unknown handle, ``target`` already live, or ``tokens`` past the
                handle's length.
        """
        handle = self._handles.get(name)
        if handle is None:
            raise EngineError(f"no KV handle {name!r}")
        self.allocator.fork(HandleKey(name), target)
        if tokens is not None:
            self.allocator.truncate(target, tokens)
        self.touch(handle)
        return handle

    def rewind(self, name: str, keys: Sequence[Hashable]) -> int | None:
        """Cut handle ``name`` back to the tokens a prompt with ``keys`` shares with it (see
        ``shared``), freeing its blocks past them now (those still shared with a live fork
        stay with it); return the tokens it keeps, or None for an unknown handle."""
        handle = self._handles.get(name)
        if handle is None:
            return None
        kept = self.shared(name, keys)
        key = HandleKey(name)
        if kept < self.allocator.num_tokens(key):
            self.allocator.truncate(key, kept)
        del handle.keys[kept:]
        handle.row_out = {p: row for p, row in handle.row_out.items() if p < kept}
        return kept


def _resume_names(value: object) -> list[str]:
    """The handle names a ``resume`` input gives: none (None or empty), one (a string) or
    several (a sequence of strings, in order of preference on a tie). Never raises."""
    if not value:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence):
        return [str(name) for name in value if name]
    return [str(value)]


class KeptKV:
    """What an engine that keeps KV in a ``HandleStore`` (its ``_handles``) shows of it: the
    handles, the blocks they hold, and dropping one."""

    _handles: HandleStore

    @property
    def handles(self) -> dict[str, tuple[str, int, int]]:
        """Every handle -> (kind: ``"session"`` or ``"prefix"``, rows, blocks it holds)."""
        return self._handles.summary()

    @property
    def kept_blocks(self) -> int:
        """Distinct KV blocks that handles hold (some may be shared with live sequences)."""
        return self._handles.kept_blocks

    def drop_handle(self, handle: str) -> bool:
        """Free ``handle``'s reference to its blocks (those still shared with live forks stay
        until the forks end); return whether it existed. Never raises. Call it between forwards
        (the forward thread, or the scheduler's when forwards run there); a scheduler with steps
        parked for memory should then ``wake`` them."""
        return self._handles.drop(handle)
