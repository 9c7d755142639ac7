"""One admission rule for every paged-KV engine: which steps of a forward get blocks now, which
wait for a release, and which fail alone because waiting could never help.

An engine describes each step of a forward as a :class:`Demand` (the sequence it appends to,
its request, the tokens it appends now and the tokens it still needs in all) and
:meth:`Admission.admit` decides, in the steps' order (the scheduler puts older work first):

1. a second step on a sequence already decided shares the first one's fate: it waits if the
   first waits, and otherwise comes back next forward (``None``);
2. a step that could never fit fails with ``KVCacheFull`` naming the sizes: its remaining tokens
   need more blocks than the pool minus what its own request holds (a request's sequences do
   not shrink while one of its steps waits, so those blocks will never be free for it);
3. a step whose tokens for this forward fit in the free blocks, beside those admitted before it,
   runs;
4. a step that does not fit now first makes room by eviction: the engine's ``evict`` frees its
   least recently used evictable holder (a named prefix), one at a time, until the step fits or
   nothing evictable is left;
5. any other step waits (``WAIT``) until some request releases memory;
6. when nothing runs and every request holding blocks is among the waiters, nobody will ever
   free any: the newest waiter is preempted with ``KVCacheFull`` so the others go on. Sequences
   that no request owns (``owner`` gives ``None``: handles that outlive requests) are freed
   only explicitly, so they never count as holders a release could free.

Pure bookkeeping over :class:`PagedKVAllocator` (no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from mstar_async.engines.base import WAIT, StepResult
from mstar_async.errors import KVCacheFull

from .allocator import PagedKVAllocator

__all__ = ["Admission", "Demand", "Verdict"]


@dataclass(frozen=True, slots=True)
class Demand:
    """What one step asks of the block pool in one forward.

    Attributes:
        seq: the allocator sequence the step appends to (must be live).
        request_id: the step's request.
        now: tokens appended in this forward (its budget's worth).
        total: tokens the step still needs before it finishes (at least ``now``; 0 means
            ``now``); decides whether it could ever fit.
        op: the step's op, for messages.
    """

    seq: Hashable
    request_id: str
    now: int
    total: int = 0
    op: str = "step"

    @property
    def remaining(self) -> int:
        """Tokens the step still needs in all."""
        return max(self.now, self.total)


@dataclass(slots=True)
class Verdict:
    """What :meth:`Admission.admit` decided.

    Attributes:
        admitted: indices of the demands that run now, in order; their blocks are free (an
            ``append_batch`` of them in this order succeeds).
        results: per demand: ``None`` for an admitted one (the engine fills in its outputs) or
            one to come back next forward, ``WAIT``, or the ``KVCacheFull`` that fails it.
    """

    admitted: list[int] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)

    @property
    def failed(self) -> list[int]:
        """Indices of the demands that failed."""
        return [i for i, r in enumerate(self.results) if isinstance(r, Exception)]


class Admission:
    """The admission rule over one engine's allocator.

    ``owner(seq)`` gives the request a live allocator sequence belongs to (branches and scratch
    forks included), or ``None`` for one no request owns. ``evict()`` frees one evictable
    holder's blocks (least recently used first) and returns whether it found one; it is called
    only when a step does not fit now (rule 4). Messages count memory in ``unit``
    (``tokens_per_unit`` tokens each) and blocks as ``block_word``, and end with ``remedy``.
    Not thread-safe: call it from the engine's forward, which the scheduler never runs
    concurrently.
    """

    def __init__(
        self,
        allocator: PagedKVAllocator,
        *,
        owner: Callable[[Hashable], str | None] = str,
        evict: Callable[[], bool] | None = None,
        unit: str = "tokens",
        tokens_per_unit: int = 1,
        block_word: str = "blocks",
        remedy: str = "give the engine a larger kv_cache_bytes or lower the concurrency",
    ) -> None:
        self.allocator = allocator
        self.owner = owner
        self.evict = evict
        self.unit = unit
        self.tokens_per_unit = tokens_per_unit
        self.block_word = block_word
        self.remedy = remedy

    def admit(self, demands: Sequence[Demand]) -> Verdict:
        """Decide every demand of one forward (see the module docstring); allocates nothing,
        but may free evictable holders through ``evict`` to make room.

        Raises:
            EngineError: a demand names a sequence the allocator does not hold, or a negative
                count.
        """
        verdict = Verdict(results=[None] * len(demands))
        alloc = self.allocator
        seqs = [d.seq for d in demands]
        if len(set(seqs)) == len(seqs) and alloc.can_append_batch({d.seq: d.now for d in demands}):
            # The common case (every decode of a batch fits): only multi-forward steps can
            # still be ones that never fit.
            for i, d in enumerate(demands):
                verdict.results[i] = self._never_fits(d) if d.remaining > d.now else None
            verdict.admitted = [i for i, r in enumerate(verdict.results) if r is None]
            return verdict
        chosen: dict[Hashable, int] = {}
        decided: dict[Hashable, StepResult] = {}
        waiting: list[int] = []
        for i, d in enumerate(demands):
            if d.seq in decided:
                verdict.results[i] = WAIT if decided[d.seq] is WAIT else None
            else:
                failure = self._never_fits(d)
                if failure is not None:
                    verdict.results[i] = failure
                elif self._fits_or_evicts({**chosen, d.seq: d.now}):
                    chosen[d.seq] = d.now
                    verdict.admitted.append(i)
                else:
                    verdict.results[i] = WAIT
                    waiting.append(i)  # a sequence's first demand speaks for it
                decided[d.seq] = verdict.results[i]
        if not verdict.admitted and waiting:
            self._preempt_if_stuck(demands, waiting, verdict.results)
        return verdict

    def _fits_or_evicts(self, asks: dict[Hashable, int]) -> bool:
        """Whether ``asks`` fit now, evicting one holder at a time until they do. Why here and
        nowhere else: eviction is the last resort before waiting, so every engine on this rule
        evicts in the same order and only when a step would otherwise wait."""
        while not self.allocator.can_append_batch(asks):
            if self.evict is None or not self.evict():
                return False
        return True

    def pinned(self, request_id: str) -> int:
        """Blocks held by any live sequence of ``request_id``, each counted once."""
        blocks: set[int] = set()
        for seq in self.allocator.seq_ids():
            if self.owner(seq) == request_id:
                blocks.update(self.allocator.block_table(seq))
        return len(blocks)

    def _never_fits(self, d: Demand) -> KVCacheFull | None:
        alloc = self.allocator
        need = alloc.blocks_needed(d.seq, d.remaining)
        if need <= alloc.num_free_blocks:
            return None  # it fits now, so it can
        pinned = self.pinned(d.request_id)
        room = alloc.num_blocks - pinned
        if need <= room:
            return None
        per = self.tokens_per_unit
        wanted = -(-(alloc.num_tokens(d.seq) + d.remaining) // per)
        capacity = alloc.num_blocks * alloc.block_size // per
        if wanted > capacity:
            return KVCacheFull(
                f"request {d.request_id} needs KV for {wanted} {self.unit} but the whole cache "
                f"holds {capacity}; {self.remedy}"
            )
        words = self.block_word
        return KVCacheFull(
            f"request {d.request_id}: {d.op} needs {need} more {words} for {d.remaining} "
            f"{self.unit} but only {room} of the cache's {alloc.num_blocks} {words} can ever be "
            f"free for it: the request holds {pinned} (its prefix and branches) that it cannot "
            f"free while this step waits; {self.remedy}"
        )

    def _preempt_if_stuck(
        self, demands: Sequence[Demand], waiting: list[int], results: list[StepResult]
    ) -> None:
        alloc = self.allocator
        holders = {self.owner(s) for s in alloc.seq_ids() if alloc.num_tokens(s) > 0}
        holders.discard(None)  # handles: only an explicit drop frees them, never a release
        if holders <= {demands[i].request_id for i in waiting}:
            victim = waiting[-1]
            results[victim] = KVCacheFull(
                f"request {demands[victim].request_id} was preempted: the KV cache "
                f"({alloc.num_blocks} {self.block_word}) is exhausted by requests that all "
                f"need more; {self.remedy}"
            )
            # Later demands of the victim's sequence follow its first one: not waiting.
            for j in range(victim + 1, len(demands)):
                if demands[j].seq == demands[victim].seq:
                    results[j] = None
