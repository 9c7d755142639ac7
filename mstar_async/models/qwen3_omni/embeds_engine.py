"""``EmbedsKVEngine``: a paged-KV decoder engine whose steps feed input *embeddings*.

The talker and the code predictor of Qwen3-Omni do not read token ids: each position's input is
a sum of embeddings (a codec frame's codebook embeddings plus a projected thinker token, or the
talker's hidden state). This engine keeps the paged KV cache, allocator, attention backend and
sampler of :mod:`mstar_async.engines.kv_engine` and lets a model-side :class:`EmbedsOp` say how
a step's inputs become rows of embeddings and how the last row's hidden state becomes outputs.

One forward runs every step of the batch, whatever its op: the rows of all steps are laid out
flat, attention is planned per sequence, and each op's ``finish`` sees the final hidden state
of its steps' last rows. An op marked ``fresh`` starts a new sequence on every call (the code
predictor decodes each frame from scratch); a request's random generator outlives that reset.
A step's rows are computed up to its token budget per forward (a long talker prompt is split
over forwards), and whether they get KV blocks is the shared admission rule of
``engines/kv/admission.py``: wait when memory is short, fail alone when it could never fit.

A sequence's leading rows may outlive its request under a handle (``engines/kv/handles.py``, as
``KVCacheEngine``'s conversations): an op with ``keys`` says what its step's leading rows *are*;
a request that ``retain``-ed keeps them, and a later step with ``resume`` starts from the longest
prefix of them its own keys share, computing only the rest (the talker's user turns, which a
conversation's next turn repeats). A keyed step may also name a handle to ``keep`` its keyed
rows under (evictable) unless that handle already holds them all: a prefix many requests share
(a registered voice's), computed on first use and again only after eviction. ``rewind`` cuts a
handle back to a prefix at once, and evictable handles give way when admission needs room.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mstar_async.engines.base import Step, StepResult, group_by_op
from mstar_async.engines.kv import (
    AttentionSpec,
    BatchLayout,
    select_attention_backend,
)
from mstar_async.engines.kv.admission import Admission, Demand
from mstar_async.engines.kv.cache import DEFAULT_BLOCK_SIZE, paged_storage
from mstar_async.engines.kv.handles import PREFIX, HandleStore, KeptKV
from mstar_async.engines.kv.sequences import HandleKey
from mstar_async.engines.kv.transfer import read_sequence, write_sequence
from mstar_async.engines.kv_engine import StepAttention
from mstar_async.engines.sampling import (
    SamplingParams,
    make_generator,
    penalize_repeats,
    sample,
)
from mstar_async.errors import EngineError

__all__ = ["EmbedsKVEngine", "EmbedsOp", "Sampler"]

_GREEDY = SamplingParams(temperature=0.0)
#: Ops the engine serves besides the model's: state kept beyond a request.
HANDLE_OPS = ("retain", "drop", "rewind")


class _Stack(Protocol):
    def __call__(self, x: torch.Tensor, attention: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class EmbedsOp:
    """How one op of the engine reads and writes.

    Attributes:
        embed: a step's inputs -> its new rows ``[n, hidden]``.
        finish: ``(last hidden rows [k, hidden], the k steps' inputs, their generators)`` ->
            one output mapping per step.
        fresh: drop the request's KV before the step (a new sequence every call).
        cost: a step's inputs -> the rows it feeds (the worker's token budget counts them).
        keys: a step's inputs -> what each of its *leading* rows is (``prefill_rows.
            prompt_keys``), for the rows a later request of the same conversation may take
            from a handle instead of computing them; None: no row is ever reused. Only a step
            that starts its request's sequence is keyed.
    """

    embed: Callable[[Mapping[str, Any]], torch.Tensor]
    finish: Callable[
        [torch.Tensor, Sequence[Mapping[str, Any]], Sequence[Sampler]],
        list[dict[str, Any]],
    ]
    fresh: bool = False
    cost: Callable[[Mapping[str, Any]], int] = lambda inputs: 1
    keys: Callable[[Mapping[str, Any]], list[Hashable]] | None = None


@dataclass
class _Pending:
    step: Step  # the step these rows belong to, so a resubmitted step is not embedded again
    rows: torch.Tensor  # [n, hidden] not yet computed


@dataclass(frozen=True)
class Sampler:
    """A request's sampling parameters and its own random generator."""

    params: SamplingParams
    generator: torch.Generator | None

    def sample(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> int:
        """Draw one id from a ``[vocab]`` row of logits; ids in ``seen`` (those already
        generated) first take the request's ``repetition_penalty``. Raises nothing."""
        row = logits.float()
        if seen is not None:
            row = penalize_repeats(row, seen, self.params.repetition_penalty)
        return int(sample(row.unsqueeze(0), [self.params], [self.generator])[0])


class EmbedsKVEngine(KeptKV):
    """Runs embedding-fed steps of many requests in one paged-attention forward.

    ``stack(x, attention)`` maps flat rows ``[n, hidden]`` to final hidden states. A request's
    sampling generator comes from the ``sampling`` input (``SamplingParams``) of its first step
    that carries one (greedy otherwise) and lives until ``release``.

    Besides the model's ops (a keyed step of one may carry ``resume``: a handle to start from,
    or several, of which the one sharing the most rows is taken; and ``keep``: a handle to keep
    its keyed rows under, evictable, when the request is released, unless that handle already
    holds every one of them), the handle ops, bookkeeping only:

    - ``retain``: ``handle``, optional ``evictable`` -> ``{}``. When the request is released,
      its sequence's keyed leading rows are kept under ``handle`` (replacing one of that name):
      never evicted, or with ``evictable`` evicted least recently used when admission needs
      room.
    - ``drop``: ``handle`` -> ``dropped`` (bool); a request in flight that was to keep its
      rows under ``handle`` no longer will.
    - ``rewind``: ``handle``, ``keys`` -> ``tokens``: the handle cut back to the longest prefix
      it shares with ``keys`` (the rule ``resume`` applies), its blocks past that freed now;
      0 for an unknown handle.

    Raises:
        ValueError: neither or both of ``kv_cache_bytes`` and ``num_blocks``; no ops.
    """

    def __init__(
        self,
        stack: _Stack,
        spec: AttentionSpec,
        ops: Mapping[str, EmbedsOp],
        *,
        num_layers: int,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        device: str | torch.device = "cpu",
    ) -> None:
        if not ops:
            raise ValueError("EmbedsKVEngine: ops must name at least one op")
        self.device = torch.device(device)
        self.allocator, self.cache = paged_storage(
            spec,
            num_layers=num_layers,
            kv_cache_bytes=kv_cache_bytes,
            num_blocks=num_blocks,
            block_size=block_size,
            device=self.device,
            owner="EmbedsKVEngine",
        )
        self.backend = select_attention_backend(self.device, spec)
        self._handles = HandleStore(self.allocator)
        self.admission = Admission(self.allocator, owner=_owner, evict=self._handles.evict_lru)
        self.stack = stack
        self.ops = dict(ops)
        self._samplers: dict[str, Sampler] = {}
        self._pending: dict[str, _Pending] = {}
        self._keys: dict[str, list[Hashable]] = {}  # request -> its sequence's keyed rows
        #: Rows ``resume`` took from handles instead of computing them.
        self.reused_tokens = 0

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by live sequences (handles' included)."""
        return self.allocator.num_used_blocks

    def cost(self, step: Step) -> int:
        """Rows the step still feeds (what is left of its prompt, or 1)."""
        pending = self._pending.get(step.request_id)
        if pending is not None and pending.step is step:
            return max(1, int(pending.rows.shape[0]))
        op = self.ops.get(step.op)
        return 1 if op is None else max(1, op.cost(step.inputs))

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """One forward over every step that gets KV blocks: up to its budget of its rows
        (handle ops first, which take no blocks).

        A step with rows left after this forward gets ``None`` (come back); a step the pool
        cannot hold now gets ``WAIT``; one that could never fit (or the newest of requests that
        all wait on each other) gets ``KVCacheFull``, which fails that request alone. A second
        step of a request in one forward waits its turn.

        Raises:
            EngineError: an unknown op, or an op's ``embed`` returning no rows.
        """
        handled = {i: self._handle_op(s) for i, s in enumerate(steps) if s.op in HANDLE_OPS}
        rest = [s for i, s in enumerate(steps) if i not in handled]
        outcomes = iter(self._forward_rows(rest) if rest else [])
        return [handled[i] if i in handled else next(outcomes) for i in range(len(steps))]

    def _handle_op(self, step: Step) -> StepResult:
        name = self._handles.bookkeeping(step, step.request_id)
        if not isinstance(name, str):
            return name  # drop, retain, or a step without a handle
        return {"tokens": self._handles.rewind(name, list(step.inputs.get("keys") or ())) or 0}

    def _forward_rows(self, steps: Sequence[Step]) -> list[StepResult]:
        demands: list[Demand] = []
        chunks: list[int] = []
        seen: set[str] = set()
        with torch.inference_mode():
            for step in steps:
                rid = step.request_id
                left = 0 if rid in seen else self._rows_left(step)
                seen.add(rid)
                chunks.append(min(left, step.budget) if step.budget else left)
                demands.append(Demand(rid, rid, chunks[-1], left, step.op))
            verdict = self.admission.admit(demands)
            for i in verdict.failed:
                self._pending.pop(steps[i].request_id, None)
            if verdict.admitted:
                self._run(steps, chunks, verdict.admitted, verdict.results)
        return verdict.results

    def export_state(self, request_id: str) -> dict[str, Any] | None:
        """The request's KV (on the CPU) and sampling state, to move them to another engine;
        they stay held here until ``release``. ``None`` if nothing is held. Runs on the
        forward thread.

        Raises:
            EngineError: a step of the request is half computed.
        """
        if request_id in self._pending:
            raise EngineError(f"request {request_id}: cannot move it while a step is running")
        sampler = self._samplers.get(request_id)
        if sampler is None:
            return None
        kv = None
        if self.allocator.has(request_id):
            kv = read_sequence(self.allocator, self.cache, request_id)
        generator = sampler.generator
        state = {
            "kv": kv,
            "sampling": sampler.params,
            "generator": None if generator is None else generator.get_state(),
            "keys": self._keys.get(request_id),
        }
        return state

    def import_state(self, request_id: str, state: dict[str, Any] | None) -> None:
        """Hold what ``export_state`` gave away.

        Raises:
            KVCacheFull: no room for its KV here (nothing changed).
            EngineError: the request is already held here.
        """
        if state is None:
            return
        if request_id in self._samplers:
            raise EngineError(f"request {request_id} is already held by this engine")
        if state["kv"] is not None:
            write_sequence(self.allocator, self.cache, request_id, state["kv"])
        params: SamplingParams = state["sampling"]
        generator = make_generator(params.seed, self.device)
        if generator is not None and state["generator"] is not None:
            generator.set_state(state["generator"])
        self._samplers[request_id] = Sampler(params, generator)
        if state.get("keys") is not None:
            self._keys[request_id] = list(state["keys"])

    def release(self, request_id: str) -> None:
        """Keep the keyed rows the request retained under their handle, then free its KV
        blocks, generator and any half-fed step; idempotent."""
        keys = self._keys.pop(request_id, None) or []
        for seq, (name, kind) in self._handles.released(request_id).items():
            kept = min(len(keys), self.allocator.num_tokens(seq)) if self.allocator.has(seq) else 0
            if kept:
                sampler = self._samplers.get(request_id)
                params = _GREEDY if sampler is None else sampler.params
                self._handles.keep(name, seq, kind, params, keys[:kept], tokens=kept)
        self._drop_kv(request_id)
        self._samplers.pop(request_id, None)
        self._pending.pop(request_id, None)

    def _rows_left(self, step: Step) -> int:
        """Rows of ``step`` not computed yet; embeds a new step (dropping the request's KV
        first for a ``fresh`` op)."""
        pending = self._pending.get(step.request_id)
        if pending is None or pending.step is not step:
            op = self._op(step.op)
            if op.fresh:
                self._drop_kv(step.request_id)
            x = op.embed(step.inputs)
            if x.dim() != 2 or x.shape[0] == 0:
                raise EngineError(f"op {step.op!r} embedded its inputs as {tuple(x.shape)}")
            skip = self._resume(step, op, x.shape[0])
            self._start(step)
            pending = _Pending(step, x[skip:].to(self.device))
            self._pending[step.request_id] = pending
        return int(pending.rows.shape[0])

    def _resume(self, step: Step, op: EmbedsOp, rows: int) -> int:
        """For a keyed step that starts its request's sequence, of a request that keeps or
        resumes a conversation: record its keys (``keep``: to be kept, if its handle lacks
        some) and, with ``resume`` (a handle, or several: the one sharing the most), start the
        sequence as the handle's rows its keys share (all but its last row at most); returns
        the rows taken."""
        rid = step.request_id
        name, keep = step.inputs.get("resume"), step.inputs.get("keep")
        if (
            op.keys is None
            or not (name or keep or self._handles.retains(rid))
            or (self.allocator.has(rid) and self.allocator.num_tokens(rid))
        ):
            return 0  # keys digest rows: made only when something may use them
        keys = op.keys(step.inputs)
        self._keys[rid] = keys
        if keep and self._handles.shared(str(keep), keys) < len(keys):
            # Kept lazily: on first use, after an eviction, or for a prompt that departs from
            # what the handle holds; otherwise the handle is left as it is.
            self._handles.retain(rid, rid, str(keep), PREFIX)
        handle, shared = self._handles.longest(name, keys)
        shared = min(shared, rows - 1)
        if shared <= 0:
            return 0
        self._drop_kv(rid)
        self._handles.fork(handle, rid, shared)
        self.reused_tokens += shared
        return shared

    def _op(self, name: str) -> EmbedsOp:
        op = self.ops.get(name)
        if op is None:
            raise EngineError(f"EmbedsKVEngine has no op {name!r}; ops: {sorted(self.ops)}")
        return op

    def _drop_kv(self, request_id: str) -> None:
        if self.allocator.has(request_id):
            self.allocator.free(request_id)

    def _start(self, step: Step) -> None:
        if not self.allocator.has(step.request_id):
            self.allocator.add(step.request_id)
        if step.request_id not in self._samplers:
            params = step.inputs.get("sampling")
            if not isinstance(params, SamplingParams):
                params = _GREEDY
            generator = make_generator(params.seed, self.device)
            self._samplers[step.request_id] = Sampler(params, generator)

    def _run(
        self,
        steps: Sequence[Step],
        chunks: list[int],
        order: list[int],
        results: list[StepResult],
    ) -> None:
        plans = self.allocator.append_batch({steps[i].request_id: chunks[i] for i in order})
        self.cache.copy_blocks([c for plan in plans for c in plan.copies])
        meta = self.backend.plan(BatchLayout.from_plans(self.allocator, plans))
        x = torch.cat([self._pending[steps[i].request_id].rows[: chunks[i]] for i in order])
        hidden = self.stack(x, StepAttention(self.cache, self.backend, meta))
        last: dict[int, torch.Tensor] = {}
        end = 0
        for i in order:
            end += chunks[i]
            pending = self._pending[steps[i].request_id]
            pending.rows = pending.rows[chunks[i] :]
            if pending.rows.shape[0] == 0:
                del self._pending[steps[i].request_id]
                last[i] = hidden[end - 1]
        finishing = list(last)
        for op, group in group_by_op([steps[i] for i in finishing]).items():
            chosen = [finishing[g] for g in group]
            outputs = self._op(op).finish(
                torch.stack([last[i] for i in chosen]),
                [steps[i].inputs for i in chosen],
                [self._samplers[steps[i].request_id] for i in chosen],
            )
            for i, out in zip(chosen, outputs, strict=True):
                results[i] = out


def _owner(seq: Hashable) -> str | None:
    """The request an allocator sequence belongs to; None for a handle's."""
    return None if isinstance(seq, HandleKey) else str(seq)
