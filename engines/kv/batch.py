"""One step's batch layout for paged attention, as plain Python (no torch).

A :class:`BatchLayout` says, for each sequence in the step (in batch order), which blocks hold
its context, how long that context is (new tokens included) and how many of its last tokens are
queries this step. Attention backends turn it into device tensors once per step
(``AttentionBackend.plan``); every layer then reuses those.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from mstar_async.errors import EngineError

from .allocator import AppendPlan, PagedKVAllocator

__all__ = ["BatchLayout"]


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Per-sequence attention inputs for one step; queries are laid out flat in batch order.

    Sequence ``i`` contributes ``query_lens[i]`` query tokens: the *last* ``query_lens[i]``
    tokens of its ``context_lens[i]`` cached tokens (their K/V already written). Query ``j`` of
    it sees keys ``0 .. context_lens[i] - query_lens[i] + j``. Prefill, chunked prefill and
    decode (query length 1) mix freely. With ``causal=False`` every query of a sequence sees
    all of its ``context_lens[i]`` keys: the new tokens attend to the cached prefix and to each
    other in both directions (the latent tokens of an image, the noisy actions of a policy).

    Attributes:
        block_size: tokens per block.
        seq_ids: the sequences, in batch order.
        block_tables: each sequence's block ids, in token order.
        context_lens: tokens in each sequence's cache, this step's tokens included.
        query_lens: query tokens each sequence contributes (>= 1, <= its context length).
        slot_mapping: flat slot of every query token, concatenated in batch order; this is
            where the layer writes the token's K and V.
        causal: whether queries see only earlier keys (the default) or every key of their
            sequence.
    """

    # Why tuples in a frozen dataclass: a layout is built once per step and read by every layer
    # (and possibly another thread building tensors); immutability makes sharing it safe.
    block_size: int
    seq_ids: tuple[Hashable, ...]
    block_tables: tuple[tuple[int, ...], ...]
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    causal: bool = True

    def __post_init__(self) -> None:
        """Check the fields agree with each other.

        Raises:
            EngineError: lengths disagree, a query length is outside ``1..context length``, a
                table is too short for its context, or the slot mapping has the wrong length.
        """
        n = len(self.seq_ids)
        if self.block_size < 1:
            raise EngineError(f"block_size must be >= 1, got {self.block_size}")
        if n == 0:
            raise EngineError("a batch needs at least one sequence")
        if not len(self.block_tables) == len(self.context_lens) == len(self.query_lens) == n:
            raise EngineError(
                f"batch fields disagree: {n} ids, {len(self.block_tables)} tables, "
                f"{len(self.context_lens)} context lengths, {len(self.query_lens)} query lengths"
            )
        for sid, table, ctx, q in zip(
            self.seq_ids, self.block_tables, self.context_lens, self.query_lens, strict=True
        ):
            if not 1 <= q <= ctx:
                raise EngineError(
                    f"sequence {sid!r}: query length {q} must be in 1..context length {ctx}"
                )
            if len(table) * self.block_size < ctx:
                raise EngineError(
                    f"sequence {sid!r}: {len(table)} block(s) of {self.block_size} cannot hold "
                    f"{ctx} tokens"
                )
        if len(self.slot_mapping) != sum(self.query_lens):
            raise EngineError(
                f"slot mapping has {len(self.slot_mapping)} entries for "
                f"{sum(self.query_lens)} query tokens"
            )

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_allocator(
        cls,
        allocator: PagedKVAllocator,
        queries: Iterable[tuple[Hashable, int]],
        *,
        causal: bool = True,
    ) -> BatchLayout:
        """Build a layout from the allocator's current tables.

        ``queries`` gives ``(seq_id, query_len)`` in batch order; each sequence's last
        ``query_len`` tokens are its queries (append them to the allocator first). ``causal``
        is the layout's field of that name.

        Raises:
            EngineError: an unknown id, a repeated id, or a query length outside
                ``1..num_tokens``.
        """
        bs = allocator.block_size
        ids: list[Hashable] = []
        tables: list[tuple[int, ...]] = []
        ctxs: list[int] = []
        qlens: list[int] = []
        slots: list[int] = []
        for seq_id, q in queries:
            if seq_id in ids:
                raise EngineError(f"sequence {seq_id!r} appears twice in one batch")
            table = tuple(allocator.block_table(seq_id))
            ctx = allocator.num_tokens(seq_id)
            if not 1 <= q <= ctx:
                raise EngineError(
                    f"sequence {seq_id!r}: query length {q} must be in 1..context length {ctx}"
                )
            ids.append(seq_id)
            tables.append(table)
            ctxs.append(ctx)
            qlens.append(q)
            slots.extend(table[p // bs] * bs + p % bs for p in range(ctx - q, ctx))
        return cls(bs, tuple(ids), tuple(tables), tuple(ctxs), tuple(qlens), tuple(slots), causal)

    @classmethod
    def from_plans(
        cls, allocator: PagedKVAllocator, plans: Sequence[AppendPlan], *, causal: bool = True
    ) -> BatchLayout:
        """Build a layout whose queries are exactly the tokens each plan appended.

        Raises:
            EngineError: a plan is stale (its sequence grew or was freed since), appended no
                token, or two plans name one sequence.
        """
        for plan in plans:
            if not allocator.has(plan.seq_id) or allocator.num_tokens(plan.seq_id) != plan.end:
                raise EngineError(
                    f"stale append plan for {plan.seq_id!r}: it ended at {plan.end} tokens"
                )
        layout = cls.from_allocator(
            allocator, [(p.seq_id, p.num_new_tokens) for p in plans], causal=causal
        )
        expected = tuple(s for p in plans for s in p.slots)
        assert layout.slot_mapping == expected, "allocator tables disagree with their plans"
        return layout

    # ------------------------------------------------------------------ derived

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.seq_ids)

    @property
    def num_query_tokens(self) -> int:
        """Query tokens in the batch (rows of ``q``)."""
        return len(self.slot_mapping)

    @property
    def max_query_len(self) -> int:
        """Longest query length in the batch."""
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        """Longest context length in the batch."""
        return max(self.context_lens)

    @property
    def is_decode_only(self) -> bool:
        """Whether every sequence contributes exactly one query token."""
        return self.max_query_len == 1

    def positions(self) -> list[int]:
        """Return each query token's position in its sequence (for RoPE), flat in batch order."""
        return [
            p
            for c, q in zip(self.context_lens, self.query_lens, strict=True)
            for p in range(c - q, c)
        ]
