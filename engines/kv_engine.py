"""``KVCacheEngine``: a decoder LM on a paged KV cache, with chunked prefill and sampling.

One progress rule drives every step: a sequence has tokens whose KV is not computed yet
(``pending``); a forward computes up to the step's token budget of them, and when none are left
it samples the next token. A prompt is a prefill step with many pending tokens (split over
forwards when it exceeds the budget); a decode step has exactly one, the token sampled last.

A request may hold several sequences: its main one and named branches (``seq`` input) made by
``fork``, which share the parent's KV blocks by reference count. ``extend`` and ``attend`` run
model-defined query tokens (image latents, noisy actions) over a sequence's cached prefix and,
in both directions, over each other; ``extend`` keeps their KV, ``attend`` writes it to scratch
blocks of a throw-away fork and frees them when the forward ends (see ``engines/kv/queries.py``).

A prefill may carry *embeddings*: rows that replace the token embeddings of some of its prompt's
positions (an audio encoder's output in place of its placeholder tokens, as multimodal LMs
scatter theirs). They ride with the pending tokens, keyed by absolute position, so a prompt
split over forwards still gets each row at its own position.

KV state may outlive a request under a *handle* (a string, kept by ``engines/kv/handles.py``):
a session's sequence kept across turns (``retain`` / ``attach``, or a ``prefill`` that
``resume``s from it: the longest prefix it shares with the new prompt is reused, the rest
computed; ``rewind`` cuts it back to that prefix at once) and named prefixes many requests fork
from (``prefix``). A handle's blocks stay in the shared pool, counted against the budget, until
it is dropped; prefix handles are also evicted, least recently used first, when admission needs
room.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_async.engines.base import WAIT, Step, StepResult
from mstar_async.engines.kv import (
    AttentionSpec,
    BatchLayout,
    PagedKVCache,
    select_attention_backend,
)
from mstar_async.engines.kv.admission import Admission, Demand
from mstar_async.engines.kv.allocator import AppendPlan
from mstar_async.engines.kv.cache import DEFAULT_BLOCK_SIZE, paged_storage
from mstar_async.engines.kv.handles import PREFIX, HandleStore, KeptKV
from mstar_async.engines.kv.prefill_rows import check_embeds, prompt_keys
from mstar_async.engines.kv.queries import QueryModel, ScratchKey, run_queries
from mstar_async.engines.kv.sequences import Before, HandleKey, SeqState
from mstar_async.engines.kv.transfer import read_sequence, write_sequence
from mstar_async.engines.sampling import SamplingParams, make_generator, sample
from mstar_async.errors import EngineError

GREEDY = SamplingParams(temperature=0.0)
TOKEN_OPS = ("prefill", "decode", "prefix")  # "prefix" computes tokens only on a miss
QUERY_OPS = ("extend", "attend")
HANDLE_OPS = ("retain", "attach", "drop", "rewind")
OPS = (*TOKEN_OPS, "fork", *QUERY_OPS, *HANDLE_OPS)
# A prefix being computed is a branch of the request computing it (so its release frees it and
# admission counts it as that request's memory); the NUL keeps it apart from user branch names.
_BUILD = "\x00prefix "


class PagedModel(Protocol):
    """What the engine needs of a model: a flat-batch forward through ``attention``, and logits.

    A model that takes prefill embeddings (``accepts_embeds`` true) also takes
    ``forward(input_ids, attention, embeds=(index, rows))``: ``rows [m, hidden]`` replace the
    embeddings of the flat positions ``index [m]``.
    """

    def forward(self, input_ids: torch.Tensor, attention: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StepAttention:
    """The attention seam for one forward: stores each layer's new K/V, then attends paged."""

    def __init__(self, cache: PagedKVCache, backend: Any, meta: Any) -> None:
        self.cache = cache
        self.backend = backend
        self.meta = meta
        self.positions: torch.Tensor = meta.positions

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        out: torch.Tensor = self.backend.forward(
            q, self.cache.key(layer), self.cache.value(layer), self.meta
        )
        return out


@dataclass
class _Work:
    demand: Demand
    tokens: list[int] = field(default_factory=list)  # a token step's tokens this forward
    # its sequence before it was admitted: pending tokens, prefill step, rows, their keys
    before: Before | None = None


def _token_list(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [int(t) for t in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(t) for t in value]


class KVCacheEngine(KeptKV):
    """Runs ``prefill`` and ``decode`` steps of many requests in one forward each.

    Ops (inputs -> outputs):

    - ``prefill``: ``tokens`` (1-D tensor or list of ids), optional ``sampling``
      (``SamplingParams``) -> ``token`` (the sampled next id, a 0-dim long tensor). A second
      prefill of the same request appends to its sequence (multi-turn, or image then text).
      Optional ``embeds`` (``[m, hidden]``) and ``embeds_at`` (``m`` increasing offsets into
      ``tokens``): those tokens' embeddings are replaced by the rows (a model with
      ``accepts_embeds``; both ``None`` for none). A bad pair fails that step alone.
      A model with ``take_embeds_out`` reports rows at the embeds positions (a multimodal
      model's hidden state there, for another component): the prefill then also outputs
      ``embeds_out`` (``[m, ...]``, one per ``embeds_at`` offset, those a resume reused
      included; None otherwise).
      Optional ``resume`` (a handle name, or a sequence of them): on an empty sequence, start
      from the longest prefix the handle's tokens share with ``tokens`` (rows compared by
      content; of several handles, the one that shares the most), at most all but the last
      token, and compute only the rest; an unknown handle computes everything. This rolls a
      kept conversation back to where a new prompt departs from it (an edited or truncated
      turn) as well as forward, and lets a turn start from a prefix computed ahead of it (a
      spoken turn prefilled while the user speaks) or from the conversation, whichever holds
      more of it.
    - ``decode``: ``token`` (the last sampled id) -> ``token``.
    - ``fork``: ``seq`` (a new branch name), optional ``parent`` (a branch name; the main
      sequence if absent) -> ``seq``. The branch shares every KV block of the parent (no
      memory is taken; copy-on-write on append). Forking the main sequence before anything
      was prefilled gives an empty branch.
    - ``extend``: the model's query inputs -> the model's outputs; the new tokens' KV stays.
    - ``attend``: the same, but the new tokens' KV is dropped after the forward.
    - ``retain``: ``handle``, optional ``evictable`` -> ``{}``. When the request is released
      (whatever its outcome), its sequence is kept under ``handle``, a *session* handle: its
      blocks stay, never evicted, until ``drop_handle``; with ``evictable``, a handle evicted
      like a prefix when admission needs room (for state a caller can recompute, as a
      ``resume`` that finds no handle does). Retaining under an existing handle replaces it.
    - ``attach``: ``handle``, optional ``sampling`` -> ``tokens`` (the handle's length, an
      int). The sequence starts as a fork of the handle's (shared blocks, copy-on-write), so a
      following ``prefill`` computes only the new turn's tokens. Fails alone with
      ``EngineError`` for an unknown handle or a sequence that already holds tokens.
    - ``prefix``: ``handle``, ``tokens``, optional ``sampling`` -> ``tokens`` (an int) and
      ``hit`` (bool). A cached handle is forked into the sequence at no compute (a hit);
      otherwise ``tokens`` are prefilled (chunked, admitted and budgeted like a prompt) into a
      new evictable *prefix* handle, which is then forked into the sequence. Nothing is
      sampled: the request's next ``prefill`` continues after the prefix.
    - ``drop``: ``handle`` -> ``dropped`` (bool): ``drop_handle`` as a step; a request in
      flight that was to keep a sequence under ``handle`` no longer will.
    - ``rewind``: ``handle``, ``tokens``, optional ``embeds`` / ``embeds_at`` (as ``prefill``)
      -> ``tokens`` (what the handle keeps, an int; 0 for an unknown handle) and
      ``embeds_out`` (the model's kept rows at the prompt's row positions it keeps, in order,
      or None). The handle is cut back to the longest prefix it shares with the prompt (the
      rule ``resume`` applies), its blocks past that freed now rather than at the next turn's
      ``resume``: a conversation whose earlier item changed (a reply truncated where the user
      stopped listening) gives back its memory as it changes.

    Every op but ``fork`` and ``drop`` takes an optional ``seq``: the branch it runs on (the main
    sequence if absent). ``extend`` and ``attend`` need a model with ``QueryModel``'s methods.
    ``release`` frees the request's main sequence and every branch, after keeping what it
    ``retain``-ed.

    KV capacity comes from ``kv_cache_bytes`` (or ``num_blocks``). Admission is the shared rule
    of ``engines/kv/admission.py``: a step the pool cannot hold now waits (``WAIT``) while
    others make progress; one that could never fit, or the newest of requests that all wait on
    each other, fails alone with ``KVCacheFull``. Before a step waits, prefix handles are evicted
    least recently used first (a hit or a creation is a use) until it fits; an evicted handle's
    blocks still shared with live forks stay until those end. ``compile`` runs the model
    through ``torch.compile`` (a backend name, or True for inductor): the model's own
    ``compile_layers`` where it has one, else its whole forward; off by default.

    Raises:
        ValueError: neither or both of ``kv_cache_bytes`` and ``num_blocks`` are given.
    """

    def __init__(
        self,
        model: PagedModel,
        spec: AttentionSpec,
        *,
        num_layers: int,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        device: str | torch.device = "cpu",
        backend: str = "auto",
        compile: bool | str = False,
    ) -> None:
        self.device = torch.device(device)
        self.spec = spec
        self.num_layers = num_layers
        self.allocator, self.cache = paged_storage(
            spec,
            num_layers=num_layers,
            kv_cache_bytes=kv_cache_bytes,
            num_blocks=num_blocks,
            block_size=block_size,
            device=self.device,
            owner="KVCacheEngine",
        )
        self.admission = Admission(
            self.allocator,
            owner=_owner,
            evict=self._evict_one,
            remedy="give the engine a larger kv_cache_bytes or lower the concurrency",
        )
        self.backend = select_attention_backend(self.device, spec, prefer=backend)  # type: ignore[arg-type]
        self.model = model
        self._forward = _maybe_compile(model, compile)
        self._sequences: dict[Hashable, SeqState] = {}
        self._branches: dict[str, set[Hashable]] = {}  # request -> its forked/named sequences
        self._handles = HandleStore(self.allocator)
        self._peak_blocks = 0
        #: Prompt tokens ``resume`` took from kept sequences instead of computing them.
        self.reused_tokens = 0

    def _evict_one(self) -> bool:
        """The admission rule's last resort before a step waits: drop the least recently used
        prefix handle. Session handles are never evicted (a conversation cannot be recomputed
        from what the engine holds)."""
        return self._handles.evict_lru()

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by live sequences."""
        return self.allocator.num_used_blocks

    @property
    def peak_blocks_in_use(self) -> int:
        """The most KV blocks held at once since the engine was built or ``reset_peak``, scratch
        blocks of ``attend`` forwards included."""
        return self._peak_blocks

    def reset_peak(self) -> None:
        """Start ``peak_blocks_in_use`` again from the blocks held now."""
        self._peak_blocks = self.allocator.num_used_blocks

    def _observe_blocks(self) -> None:
        self._peak_blocks = max(self._peak_blocks, self.allocator.num_used_blocks)

    def cost(self, step: Step) -> int:
        """Tokens the step still has to compute: its prompt (what is left of it), an
        ``extend``/``attend`` step's query tokens (never split over forwards), or 1."""
        seq = self._sequences.get(_key(step))
        if step.op in ("prefill", "prefix"):
            if seq is not None and seq.prefill is step:
                return max(1, len(seq.pending))
            if step.op == "prefix" and self._is_hit(step):
                return 1
            return max(1, len(_token_list(step.inputs.get("tokens", ()))))
        if step.op in QUERY_OPS:
            # The batching loop asks before any forward: a bad step costs 1 here and gets its
            # error from ``forward``, where it fails that request alone.
            try:
                return max(1, self._query_model().query_length(step.inputs))
            except EngineError:
                return 1
        return 1

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Compute the pending tokens of every step that fits in the KV cache in one model
        forward (query steps in one non-causal forward per op), then sample for each token step
        that has none left.

        Which steps get blocks is the shared admission rule (``engines/kv/admission.py``): a
        step that does not fit now gets ``WAIT``; one that could never fit (or that is
        preempted because every request holding memory is itself waiting for more) gets a
        ``KVCacheFull`` result, which fails that request alone.

        Raises:
            EngineError: an unknown op, a decode for a request that never prefilled, a step
                without tokens, a query op on a model without query methods.
        """
        for step in steps:
            if step.op not in OPS:
                raise EngineError(f"KVCacheEngine has no op {step.op!r}; ops: {', '.join(OPS)}")
        results: list[StepResult] = [None] * len(steps)
        for i, step in enumerate(steps):
            if step.op == "fork":
                results[i] = self._fork(step)
            elif step.op in HANDLE_OPS:
                results[i] = self._handle_op(step)
            elif step.op == "prefix" and self._is_hit(step):
                results[i] = self._prefix_hit(step)
        scratch: list[Hashable] = []
        try:
            work = self._demands(steps, results, scratch)
            order = list(work)
            verdict = self.admission.admit([work[i].demand for i in order])
            admitted = [order[k] for k in verdict.admitted]
            for i, result in zip(order, verdict.results, strict=True):
                results[i] = result
                if steps[i].op in TOKEN_OPS and (result is WAIT or isinstance(result, Exception)):
                    self._undo_tokens(steps[i], work[i].before, failed=result is not WAIT)
            if admitted:
                with torch.inference_mode():
                    self._run(steps, work, admitted, results)
        finally:
            for seq in scratch:
                self.allocator.free(seq)
        return results

    def _demands(
        self, steps: Sequence[Step], results: list[StepResult], scratch: list[Hashable]
    ) -> dict[int, _Work]:
        """What each token or query step asks of the pool (with a token step's tokens for
        this forward); a malformed query step gets its error in ``results`` instead."""
        work: dict[int, _Work] = {}
        seen: set[Hashable] = set()
        for i, step in enumerate(steps):
            key = _key(step)
            if results[i] is not None:
                continue  # a handle op or a prefix hit, done without the pool
            if step.op in TOKEN_OPS:
                if key in seen:  # admission defers it; its tokens are not taken yet
                    work[i] = _Work(Demand(key, step.request_id, 0))
                    continue
                refused = check_embeds(step, getattr(self.model, "accepts_embeds", False))
                if refused is not None:
                    results[i] = refused
                    continue
                if step.op == "prefill" and step.inputs.get("resume"):
                    self._resume(step, key)
                seq = self._sequence_for(step)
                if step.ahead:
                    generator = seq.generator
                    state = None if generator is None else generator.get_state()
                    seq.ahead = (step, self.allocator.num_tokens(key), len(seq.keys), state)
                before = (
                    None
                    if seq.prefill is step
                    else (list(seq.pending), seq.prefill, dict(seq.rows), dict(seq.row_keys))
                )
                tokens = self._admit_tokens(step, seq)
                demand = Demand(key, step.request_id, len(tokens), len(seq.pending), step.op)
                work[i] = _Work(demand, tokens, before)
                seen.add(key)
            elif step.op in QUERY_OPS:
                query = self._query_demand(step, i, key, scratch)
                if isinstance(query, EngineError):
                    results[i] = query
                else:
                    work[i] = _Work(query)
                    seen.add(query.seq)
        return work

    def discard(self, step: Step) -> None:
        """Undo a decode step launched ahead of its walk that the walk did not take (its loop
        stopped): its token's KV, its key and its sampler's draw, so the sequence is as if it
        never ran. A step that never ran here, or whose sequence was released since, changes
        nothing. Never raises."""
        key = _key(step)
        seq = self._sequences.get(key)
        if seq is None or seq.ahead is None or seq.ahead[0] is not step:
            return  # it never ran here
        _, tokens, keys, state = seq.ahead
        seq.ahead = None
        if self.allocator.has(key) and self.allocator.num_tokens(key) > tokens:
            self.allocator.truncate(key, tokens)
        del seq.keys[keys:]
        seq.pending.clear()
        if state is not None and seq.generator is not None:
            seq.generator.set_state(state)

    def _resume(self, step: Step, key: Hashable) -> None:
        """Start an empty sequence as the longest prefix that its prompt shares with a handle
        ``resume`` names (a fork, truncated: no memory taken but a copy-on-write block later);
        nothing when no handle shares any, the sequence holds tokens, or this step resumed it
        already (a resubmit after waiting)."""
        seq = self._sequences.get(key)
        if seq is not None and (
            (seq.resumed is not None and seq.resumed[0] is step)
            or seq.pending
            or seq.keys
            or (self.allocator.has(key) and self.allocator.num_tokens(key))
        ):
            return
        tokens = _token_list(step.inputs.get("tokens", ()))
        keys = prompt_keys(tokens, step.inputs.get("embeds"), step.inputs.get("embeds_at"))
        name, shared = self._handles.longest(step.inputs["resume"], keys)
        shared = min(shared, len(tokens) - 1)
        if shared <= 0:
            return
        if self.allocator.has(key):
            self.allocator.free(key)
        handle = self._handles.fork(name, key, shared)
        params = step.inputs.get("sampling") or handle.params
        resumed = SeqState(params, make_generator(params.seed, self.device))
        resumed.keys = handle.keys[:shared]
        resumed.row_out = {p: row for p, row in handle.row_out.items() if p < shared}
        resumed.resumed = (step, shared)
        self._sequences[key] = resumed
        if isinstance(key, tuple):
            self._branches.setdefault(step.request_id, set()).add(key)
        self.reused_tokens += shared

    def _query_demand(
        self, step: Step, index: int, key: Hashable, scratch: list[Hashable]
    ) -> Demand | EngineError:
        model = self._query_model()
        try:
            n = model.query_length(step.inputs)
        except EngineError as exc:
            return exc
        if key not in self._sequences:
            if step.op == "attend" or key != step.request_id:
                return EngineError(
                    f"request {step.request_id}: {step.op} on sequence {_name(key)!r}, which "
                    "does not exist; prefill or fork it first"
                )
            self._new_sequence(key, GREEDY)
        target: Hashable = key
        if step.op == "attend":
            target = ScratchKey(key, index, step.request_id)
            self.allocator.fork(key, target)
            scratch.append(target)
        return Demand(target, step.request_id, n, n, step.op)

    def _query_model(self) -> QueryModel:
        if not isinstance(self.model, QueryModel):
            raise EngineError(
                f"{type(self.model).__name__} cannot run extend/attend: it needs query_length "
                "and forward_queries (see engines/kv/queries.py QueryModel)"
            )
        return self.model

    def _fork(self, step: Step) -> StepResult:
        name = step.inputs.get("seq")
        if not isinstance(name, str) or not name:
            return EngineError(f"request {step.request_id}: fork needs seq=<new branch name>")
        parent_name = step.inputs.get("parent")
        parent = step.request_id if not parent_name else (step.request_id, parent_name)
        child = (step.request_id, name)
        if parent == step.request_id and parent not in self._sequences:
            self._new_sequence(parent, GREEDY)
        source = self._sequences.get(parent)
        if source is None:
            return EngineError(
                f"request {step.request_id}: cannot fork {name!r} from {parent_name!r}, which "
                "does not exist; fork or prefill it first"
            )
        if child in self._sequences:
            return EngineError(f"request {step.request_id}: branch {name!r} already exists")
        if source.pending:
            return EngineError(
                f"request {step.request_id}: cannot fork {_name(parent)!r} while its prefill is "
                "still being computed"
            )
        self.allocator.fork(parent, child)
        self._sequences[child] = SeqState(
            source.params, make_generator(source.params.seed, self.device)
        )
        self._sequences[child].keys = list(source.keys)
        self._branches.setdefault(step.request_id, set()).add(child)
        return {"seq": name}

    def _handle_op(self, step: Step) -> StepResult:
        """``retain``, ``attach``, ``drop`` and ``rewind``: bookkeeping only, no memory taken."""
        name = self._handles.bookkeeping(step, _key(step))
        if not isinstance(name, str):
            return name  # drop, retain, or a step without a handle
        if step.op == "rewind":
            return self._rewind(step, name)
        if name not in self._handles:
            return EngineError(
                f"request {step.request_id}: attach to handle {name!r}, which does not exist "
                "(never retained, or dropped)"
            )
        return self._fork_handle(step, name, _key(step))

    def _rewind(self, step: Step, name: str) -> StepResult:
        """Cut handle ``name`` back to what the prompt ``tokens`` (with its rows) shares with
        it: ``tokens`` kept (0 for an unknown handle) and ``embeds_out``, the rows the model
        reported at the prompt's row positions among them (a leading run, in order; None if
        none)."""
        refused = check_embeds(step, getattr(self.model, "accepts_embeds", False))
        if refused is not None:
            return refused
        tokens = _token_list(step.inputs.get("tokens", ()))
        at = step.inputs.get("embeds_at")
        kept = self._handles.rewind(name, prompt_keys(tokens, step.inputs.get("embeds"), at))
        handle = self._handles.get(name)
        kept_rows = {} if handle is None else handle.row_out
        rows: list[torch.Tensor] = []
        for position in [] if at is None else at.reshape(-1).tolist():
            row = kept_rows.get(int(position))
            if row is None:
                break
            rows.append(row)
        return {"tokens": kept or 0, "embeds_out": torch.stack(rows) if rows else None}

    def _is_hit(self, step: Step) -> bool:
        """Whether a ``prefix`` step finds its handle cached (and is not already computing it)."""
        build = self._sequences.get(_key(step))
        if build is not None and build.prefill is step:
            return False
        return str(step.inputs.get("handle")) in self._handles

    def _prefix_hit(self, step: Step) -> StepResult:
        name = str(step.inputs.get("handle"))
        out = self._fork_handle(step, name, _target(step))
        return {"tokens": out["tokens"], "hit": True} if isinstance(out, dict) else out

    def _prefix_built(self, step: Step) -> dict[str, Any] | EngineError:
        """A ``prefix`` miss computed its last token: its build branch becomes the handle (a
        fork and a free: no copy), then the request's sequence forks from it. Another request
        may have built the same name meanwhile: that handle stays and this build is dropped."""
        name = str(step.inputs.get("handle"))
        build = _key(step)
        if name not in self._handles:
            made = self._sequences[build]
            self._handles.keep(name, build, PREFIX, made.params, made.keys)
        self._drop_sequence(build)
        out = self._fork_handle(step, name, _target(step))
        return {"tokens": out["tokens"], "hit": False} if isinstance(out, dict) else out

    def _fork_handle(self, step: Step, name: str, target: Hashable) -> dict[str, Any] | EngineError:
        """Start ``target`` as a fork of handle ``name`` (shared blocks, no memory taken). An
        empty ``target`` (a fork of a main sequence that held nothing) is replaced."""
        current = self._sequences.get(target)
        if current is not None and (current.pending or self.allocator.num_tokens(target)):
            return EngineError(
                f"request {step.request_id}: cannot {step.op} handle {name!r} onto sequence "
                f"{_name(target)!r}, which already holds tokens"
            )
        if current is not None:
            self.allocator.free(target)
        handle = self._handles.fork(name, target)
        params = step.inputs.get("sampling") or handle.params
        self._sequences[target] = SeqState(params, make_generator(params.seed, self.device))
        self._sequences[target].keys = list(handle.keys)
        if isinstance(target, tuple):
            self._branches.setdefault(step.request_id, set()).add(target)
        return {"tokens": self.allocator.num_tokens(target)}

    def _drop_sequence(self, key: Hashable) -> None:
        self._sequences.pop(key, None)
        if self.allocator.has(key):
            self.allocator.free(key)
        if isinstance(key, tuple):
            self._branches.get(str(key[0]), set()).discard(key)

    def export_state(self, request_id: str) -> dict[str, Any] | None:
        """Everything held for ``request_id``'s main sequence (its KV, pending tokens, sampling
        state), to move it to another engine (prefill on one rank, decode on another); it stays
        held here until ``release``. ``None`` if nothing is held. Runs on the forward thread.
        Never raises."""
        seq = self._sequences.get(request_id)
        if seq is None or not self.allocator.has(request_id):
            return None
        state = {
            "kv": read_sequence(self.allocator, self.cache, request_id),
            "pending": list(seq.pending),
            "rows": dict(seq.rows),
            "row_keys": dict(seq.row_keys),
            "keys": list(seq.keys),
            "sampling": seq.params,
            "generator": None if seq.generator is None else seq.generator.get_state(),
        }
        return state

    def import_state(self, request_id: str, state: dict[str, Any] | None) -> None:
        """Take over a request ``export_state`` gave away: allocate its KV and write it in.

        Raises:
            KVCacheFull: this engine has no room for the request's KV (nothing changed).
            EngineError: the request is already held here.
        """
        if state is None:
            return
        if request_id in self._sequences:
            raise EngineError(f"request {request_id} is already held by this engine")
        write_sequence(self.allocator, self.cache, request_id, state["kv"])
        params: SamplingParams = state["sampling"]
        seq = SeqState(params, make_generator(params.seed, self.device), list(state["pending"]))
        seq.rows = {int(k): v.to(self.device) for k, v in state.get("rows", {}).items()}
        seq.row_keys = dict(state.get("row_keys", {}))
        seq.keys = list(state.get("keys", []))
        if seq.generator is not None and state["generator"] is not None:
            seq.generator.set_state(state["generator"])
        self._sequences[request_id] = seq

    def release(self, request_id: str) -> None:
        """Keep the sequences the request retained under their handles, then free its KV blocks
        (main sequence and branches) and sampling state; idempotent."""
        for key, (name, kind) in self._handles.released(request_id).items():
            seq = self._sequences.get(key)
            if seq is None or not self.allocator.has(key):
                continue  # nothing was ever computed on it: there is nothing to keep
            kept = seq.keys[: self.allocator.num_tokens(key)]
            self._handles.keep(name, key, kind, seq.params, kept, row_out=seq.row_out)
        for key in [request_id, *self._branches.pop(request_id, ())]:
            self._sequences.pop(key, None)
            if self.allocator.has(key):
                self.allocator.free(key)

    def _admit_tokens(self, step: Step, seq: SeqState) -> list[int]:
        """The tokens this step computes now (its budget's worth of its pending tokens)."""
        if step.op in ("prefill", "prefix") and seq.prefill is not step:
            tokens = _token_list(step.inputs.get("tokens", ()))
            if not tokens:
                raise EngineError(f"request {step.request_id}: {step.op} got no tokens")
            # A resumed prefill has its first ``skip`` tokens in the sequence already.
            skip = seq.resumed[1] if seq.resumed is not None and seq.resumed[0] is step else 0
            rows = step.inputs.get("embeds")
            seq.prefill_rows = []
            if rows is not None:
                at = step.inputs["embeds_at"]
                keys = prompt_keys(tokens, rows, at)
                base = self.allocator.num_tokens(_key(step)) + len(seq.pending) - skip
                rows = rows.to(self.device)
                for j, k in enumerate(int(k) for k in at.reshape(-1).tolist()):
                    seq.prefill_rows.append(base + k)
                    if k >= skip:
                        seq.rows[base + k] = rows[j]
                        seq.row_keys[base + k] = keys[k]
            seq.pending.extend(tokens[skip:])
            seq.prefill = step
        elif step.op == "decode":
            seq.pending = _token_list(step.inputs["token"])
        budget = step.budget or len(seq.pending)
        return seq.pending[:budget]

    def _sequence_for(self, step: Step) -> SeqState:
        key = _key(step)
        seq = self._sequences.get(key)
        if seq is not None and step.op == "prefix" and seq.prefill is not step:
            # A build left over by an earlier step that failed: start this one afresh.
            self._drop_sequence(key)
            seq = None
        if seq is not None:
            return seq
        if step.op == "decode":
            raise EngineError(
                f"request {step.request_id}: decode before prefill; run prefill first"
            )
        return self._new_sequence(key, step.inputs.get("sampling") or GREEDY)

    def _new_sequence(self, key: Hashable, params: SamplingParams) -> SeqState:
        seq = SeqState(params, make_generator(params.seed, self.device))
        self._sequences[key] = seq
        self.allocator.add(key)
        if isinstance(key, tuple):
            self._branches.setdefault(key[0], set()).add(key)
        return seq

    def _undo_tokens(self, step: Step, before: Before | None, *, failed: bool) -> None:
        """A token step that did not run leaves no trace: should it be withdrawn, nothing of
        it may reach the sequence's next step. A failed step that had begun drops the rest."""
        seq = self._sequences[_key(step)]
        if before is not None:
            seq.pending, seq.prefill, seq.rows, seq.row_keys = before
        elif failed:
            seq.pending.clear()
            seq.rows.clear()
            seq.row_keys.clear()
            seq.prefill = None

    def _run(
        self,
        steps: Sequence[Step],
        work: dict[int, _Work],
        admitted: list[int],
        results: list[StepResult],
    ) -> None:
        """Append every admitted step's tokens at once, then run the token forward and one
        query forward per op; outputs go into ``results``."""
        demands = [work[i].demand for i in admitted]
        plans = self.allocator.append_batch({d.seq: d.now for d in demands})
        self._observe_blocks()
        self.cache.copy_blocks([c for plan in plans for c in plan.copies])
        by_step = dict(zip(admitted, plans, strict=True))
        tokens = [i for i in admitted if steps[i].op in TOKEN_OPS]
        if tokens:
            done = self._run_tokens(steps, work, tokens, [by_step[i] for i in tokens])
            for i, out in done.items():
                results[i] = out
        for op in QUERY_OPS:
            chosen = [i for i in admitted if steps[i].op == op]
            if chosen:
                outputs = run_queries(
                    self._query_model(),
                    op,
                    [steps[i].inputs for i in chosen],
                    [by_step[i] for i in chosen],
                    allocator=self.allocator,
                    plan=self.backend.plan,
                    attention=lambda meta: StepAttention(self.cache, self.backend, meta),
                )
                for i, out in zip(chosen, outputs, strict=True):
                    results[i] = out

    def _run_tokens(
        self,
        steps: Sequence[Step],
        work: dict[int, _Work],
        admitted: list[int],
        plans: list[AppendPlan],
    ) -> dict[int, StepResult]:
        """One token forward of the admitted steps; returns the outputs of those that finished:
        a sampled ``token``, or a built prefix's ``tokens`` and ``hit``."""
        meta = self.backend.plan(BatchLayout.from_plans(self.allocator, plans))
        flat = [t for i in admitted for t in work[i].tokens]
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        attention = StepAttention(self.cache, self.backend, meta)
        embeds, where = self._embeds(steps, work, admitted)
        if embeds is None:
            hidden = self._forward(input_ids, attention)
        else:
            hidden = self._forward(input_ids, attention, embeds=embeds)
            self._keep_embeds_out(where)
        finishing: list[int] = []
        rows: list[int] = []
        done: dict[int, StepResult] = {}
        end = 0
        for i in admitted:
            seq = self._sequences[_key(steps[i])]
            end += len(work[i].tokens)
            base = self.allocator.num_tokens(_key(steps[i])) - len(work[i].tokens)
            seq.keys.extend(
                seq.row_keys.pop(base + j, token) if seq.row_keys else token
                for j, token in enumerate(work[i].tokens)
            )
            del seq.pending[: len(work[i].tokens)]
            if not seq.pending:
                seq.prefill = None
                if steps[i].op == "prefix":
                    done[i] = self._prefix_built(steps[i])
                    continue
                finishing.append(i)
                rows.append(end - 1)
        if not finishing:
            return done
        logits = self.model.compute_logits(hidden[rows]).float()
        seqs = [self._sequences[_key(steps[i])] for i in finishing]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for k, i in enumerate(finishing):
            out: dict[str, Any] = {"token": tokens[k]}
            if steps[i].op == "prefill":
                out["embeds_out"] = self._embeds_out(seqs[k])
            done[i] = out
        return done

    def _keep_embeds_out(self, where: list[tuple[SeqState, int]]) -> None:
        """Keep what the model reports at this forward's row positions (``take_embeds_out``:
        a multimodal model's hidden rows for another component), by absolute position."""
        take = getattr(self.model, "take_embeds_out", None)
        out = take() if callable(take) else None
        if out is None:
            return
        for (seq, position), row in zip(where, out, strict=True):
            seq.row_out[position] = row

    def _embeds_out(self, seq: SeqState) -> torch.Tensor | None:
        """The finished prefill's ``embeds_out``: the model's rows at each of its embeds
        positions, in order (those a resume reused come from the handle), or None."""
        if not seq.prefill_rows:
            return None
        rows = [seq.row_out.get(position) for position in seq.prefill_rows]
        kept = [row for row in rows if row is not None]
        return torch.stack(kept) if len(kept) == len(rows) else None

    def _embeds(
        self, steps: Sequence[Step], work: dict[int, _Work], admitted: list[int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[tuple[SeqState, int]]]:
        """The rows this forward's tokens take in place of their embeddings, as ``(flat
        index, rows)``, taken from their sequences (None when there are none), and each row's
        sequence and absolute position (called after the tokens were appended, so a step's
        first token sits at ``num_tokens - len(tokens)``)."""
        index: list[int] = []
        rows: list[torch.Tensor] = []
        where: list[tuple[SeqState, int]] = []
        offset = 0
        for i in admitted:
            count = len(work[i].tokens)
            seq = self._sequences[_key(steps[i])]
            if seq.rows:
                base = self.allocator.num_tokens(_key(steps[i])) - count
                for j in range(count):
                    row = seq.rows.pop(base + j, None)
                    if row is not None:
                        index.append(offset + j)
                        rows.append(row)
                        where.append((seq, base + j))
            offset += count
        if not rows:
            return None, where
        flat = torch.tensor(index, dtype=torch.long, device=self.device)
        return (flat, torch.stack(rows)), where


def _owner(seq: Hashable) -> str | None:
    """The request an allocator sequence belongs to: its main sequence, a branch or a scratch
    fork."""
    if isinstance(seq, ScratchKey):
        return seq.request_id
    if isinstance(seq, HandleKey):
        return None
    return str(seq[0]) if isinstance(seq, tuple) else str(seq)


def _key(step: Step) -> Hashable:
    """The allocator key of the sequence a step computes on: the request id for its main
    sequence (so a request without branches is keyed exactly as before), ``(request, name)``
    for a branch, and a ``prefix`` step's build branch."""
    if step.op == "prefix":
        return (step.request_id, _BUILD + str(step.inputs.get("handle")))
    name = step.inputs.get("seq")
    return step.request_id if not name else (step.request_id, str(name))


def _target(step: Step) -> Hashable:
    """The sequence a ``prefix`` step forks its handle into (``_key`` gives its build)."""
    name = step.inputs.get("seq")
    return step.request_id if not name else (step.request_id, str(name))


def _name(key: Hashable) -> str:
    return str(key[1]) if isinstance(key, tuple) else "main"


def _maybe_compile(model: Any, compile: bool | str) -> Any:
    """The forward to run: ``model.forward``, compiled as the model knows how (its
    ``compile_layers``) or whole."""
    if not compile:
        return model.forward
    backend = compile if isinstance(compile, str) else "inductor"
    if hasattr(model, "compile_layers"):
        model.compile_layers(backend)
        return model.forward
    return torch.compile(model.forward, backend=backend, dynamic=True)
