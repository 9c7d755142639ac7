"""Shared helpers for the chunk policy tests: random streams, a runner, and comparisons."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from hypothesis import settings
from hypothesis import strategies as st

from mstar_async.policies import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

Kind = Literal["list", "tensor"]
KINDS: tuple[Kind, ...] = ("list", "tensor")
Items = list[Any] | torch.Tensor

# No example database: the tests must not write outside their own folders.
PROPERTY = settings(max_examples=200, deadline=None, database=None)

MAX_PUSH = 30
MAX_PUSHES = 16

fixed_policies = st.builds(FixedChunkPolicy, size=st.integers(1, 12))
sliding_policies = st.integers(1, 12).flatmap(
    lambda w: st.builds(SlidingWindowChunkPolicy, window=st.just(w), stride=st.integers(1, w))
)
left_context_policies = st.builds(
    LeftContextChunkPolicy,
    chunk=st.integers(1, 10),
    left_context=st.integers(0, 12),
    lookahead=st.sampled_from([0, 0, 1, 2, 5, 14]),
)
POLICY_FAMILIES = {
    "fixed": fixed_policies,
    "sliding": sliding_policies,
    "left_context": left_context_policies,
}


@st.composite
def split_streams(draw: st.DrawFn, kind: Kind) -> tuple[Items, list[Items]]:
    """A random stream and a random split of it into pushes, empty pushes included.

    Push sizes are drawn (so failures shrink to few, small pushes); item values come from a
    drawn seed, which keeps generation cheap enough for hundreds of examples per test.
    """
    sizes = draw(st.lists(st.integers(0, MAX_PUSH), max_size=MAX_PUSHES), label="push sizes")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    n = sum(sizes)
    stream: Items
    if kind == "list":
        rng = random.Random(seed)
        stream = [rng.getrandbits(48) for _ in range(n)]
    else:
        stream = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
    pushes: list[Items] = []
    lo = 0
    for size in sizes:
        piece = stream[lo : lo + size]
        if size == 0 and draw(st.booleans()):
            piece = []  # an empty list is "no items" for either kind
        pushes.append(piece)
        lo += size
    return stream, pushes


@dataclass
class Run:
    """What one policy returned for one stream: per push, and on close."""

    counts: list[int] = field(default_factory=list)  # items pushed so far, after each push
    per_push: list[list[Chunk]] = field(default_factory=list)
    buffered: list[int] = field(default_factory=list)  # policy.buffered after each push
    closing: list[Chunk] = field(default_factory=list)

    @property
    def pushed_chunks(self) -> list[Chunk]:
        return [c for chunks in self.per_push for c in chunks]

    @property
    def chunks(self) -> list[Chunk]:
        return [*self.pushed_chunks, *self.closing]


def run(policy: ChunkPolicy, pushes: list[Items]) -> Run:
    out = Run()
    total = 0
    for items in pushes:
        out.per_push.append(policy.push(items))
        total += len(items)
        out.counts.append(total)
        out.buffered.append(policy.buffered)
        assert policy.pushed == total
    out.closing = policy.close()
    return out


def same_items(a: Items, b: Items) -> bool:
    """Equal item sequences of the same kind (tensors: same dtype, shape and values)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return a == b
    return False


def concat(parts: list[Items], like: Items) -> Items:
    if isinstance(like, torch.Tensor):
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]
        assert len(tensors) == len(parts)
        return torch.cat([like[:0], *tensors], dim=0)
    return [x for part in parts for x in part]


def expected_count(policy: ChunkPolicy) -> Callable[[int], int]:
    """How many chunks are complete, hence emitted by push, once n items have arrived."""
    if isinstance(policy, FixedChunkPolicy):
        return lambda n: n // policy.size
    if isinstance(policy, SlidingWindowChunkPolicy):
        return lambda n: 0 if n < policy.window else (n - policy.window) // policy.stride + 1
    if isinstance(policy, LeftContextChunkPolicy):
        return lambda n: max(0, n - policy.lookahead) // policy.chunk
    raise AssertionError(policy)


def retention_bound(policy: ChunkPolicy) -> int:
    """Most items a policy may retain after a push."""
    if isinstance(policy, FixedChunkPolicy):
        return policy.size - 1
    if isinstance(policy, SlidingWindowChunkPolicy):
        return policy.window
    if isinstance(policy, LeftContextChunkPolicy):
        return policy.chunk - 1 + policy.left_context + policy.lookahead
    raise AssertionError(policy)
