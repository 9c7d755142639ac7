"""The engine's bookkeeping for one KV sequence and one handle (state that outlives a
request): plain records, no logic. See ``kv_engine.py`` for how they are used."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from mstar_async.engines.base import Step
from mstar_async.engines.sampling import SamplingParams

__all__ = ["Before", "Handle", "HandleKey", "SeqState"]


@dataclass(frozen=True, slots=True)
class HandleKey:
    """The allocator key of a handle's sequence: no request owns it, only the handle."""

    name: str


@dataclass
class Handle:
    kind: str  # "session" (never evicted) or "prefix" (evictable)
    params: SamplingParams
    used: int  # the engine's use counter when last created or hit: the LRU order
    keys: list[Hashable] = field(default_factory=list)  # of its tokens (see prompt_keys)
    row_out: dict[int, torch.Tensor] = field(default_factory=dict)  # as SeqState's


@dataclass
class SeqState:
    params: SamplingParams
    generator: torch.Generator | None
    pending: list[int] = field(default_factory=list)
    prefill: Step | None = None  # the prefill step being computed, so a resubmit is not re-added
    # Embedding rows of pending tokens, by absolute position in the sequence: a position keeps
    # its row however the prompt is split over forwards, and a computed one drops it.
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    row_keys: dict[int, Hashable] = field(default_factory=dict)  # those positions' keys
    keys: list[Hashable] = field(default_factory=list)  # of its computed tokens, in order
    resumed: tuple[Step, int] | None = None  # the prefill that resumed it, and tokens reused
    # What the model reported at row positions (``take_embeds_out``), by absolute position,
    # and the positions of the current prefill's rows (its ``embeds_out``, in order).
    row_out: dict[int, torch.Tensor] = field(default_factory=dict)
    prefill_rows: list[int] = field(default_factory=list)
    # The latest decode step launched ahead of its walk, and before it ran: the sequence's
    # tokens, the length of ``keys`` and the generator's state, to undo it (``discard``).
    ahead: tuple[Step, int, int, torch.Tensor | None] | None = None


Before = tuple[list[int], Step | None, dict[int, torch.Tensor], dict[int, Hashable]]
