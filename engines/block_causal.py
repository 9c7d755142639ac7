"""``BlockCausalKVEngine``: a frame-by-frame transformer on a paged KV cache.

World models roll a predictor out one frame at a time, and a frame is a block of tokens that
attend to each other and to every earlier frame (block-causal attention). Keeping each
request's keys and values between steps means a step computes only its new frame's tokens,
where re-running the whole growing context makes step ``t`` cost ``t`` frames.

The KV cache is the paged one of ``engines/kv`` with one block per frame (``block_size`` is the
model's tokens per frame), so a block table is a request's frames in order and the
block-causal rule is one comparison: key block ``<=`` query frame. Steps of many requests
(a context prefill of several frames beside one-frame steps) run as one forward: token-wise
layers on the flat tokens, attention on a padded ``[requests, rows, keys]`` batch.

One progress rule, as in ``KVCacheEngine``: a step brings frames whose KV is not computed yet;
a forward computes as many as its token budget allows (at least one frame), and the step's
outputs come once none are left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mstar_async.engines.base import Step, StepResult
from mstar_async.engines.kv import AttentionSpec, PagedKVAllocator, PagedKVCache
from mstar_async.engines.kv.admission import Admission, Demand
from mstar_async.engines.kv.transfer import read_sequence, write_sequence
from mstar_async.errors import EngineError


class LayerAttention(Protocol):
    """``attend(layer, q, k, v) -> out``: the attention seam a ``FrameModel`` calls per layer."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class FrameModel(Protocol):
    """What the engine needs of a model: its ops as frames of tokens, a flat forward through
    the attention seam, and the outputs made from each finished step's last frame."""

    tokens_per_frame: int

    def new_frames(self, step: Step) -> int:
        """Frames ``step`` appends (for ``cost``, before anything is computed)."""
        ...

    def embed(self, step: Step, frames_held: int) -> torch.Tensor:
        """The step's new tokens ``[frames * tokens_per_frame, dim]``; ``frames_held`` is what
        the request has cached already. Raises ``EngineError`` for an unknown op or bad
        inputs."""
        ...

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        """Hidden states ``[tokens, dim]`` of tokens ``x`` at their absolute ``positions``."""
        ...

    def finish(self, steps: Sequence[Step], last_frames: torch.Tensor) -> list[dict[str, Any]]:
        """Each step's outputs from the hidden states of its last frame ``[steps, tokens, dim]``."""
        ...


@dataclass
class _Pending:
    step: Step  # the step whose frames these are, so a resubmitted step is not re-embedded
    tokens: torch.Tensor  # [frames * tokens_per_frame, dim] not yet computed


class BlockCausalAttention:
    """One forward's attention: writes each layer's new K/V to the cache, then attends every
    query to its request's cached frames up to its own, in one padded SDPA call.

    ``layout`` is, per request in batch order, ``(block_table, first_new_token, new_tokens)``.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        layout: Sequence[tuple[Sequence[int], int, int]],
        device: torch.device,
    ) -> None:
        self.cache = cache
        fpt = cache.block_size
        self.batch = len(layout)
        self.rows = max(n for _, _, n in layout)
        self.blocks = max(len(table) for table, _, _ in layout)
        slots: list[int] = []
        rows: list[int] = []
        block_index: list[int] = []
        query_frames: list[list[int]] = []
        for i, (table, start, n) in enumerate(layout):
            slots.extend(table[p // fpt] * fpt + p % fpt for p in range(start, start + n))
            rows.extend(i * self.rows + r for r in range(n))
            block_index.extend([*table, *[table[0]] * (self.blocks - len(table))])
            # Padded rows repeat the last real row's frame, so no row sees nothing.
            query_frames.append([(start + min(r, n - 1)) // fpt for r in range(self.rows)])
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.block_index = torch.tensor(block_index, dtype=torch.int64, device=device)
        same = all(n == self.rows for _, _, n in layout)
        self.pad_rows = None if same else torch.tensor(rows, dtype=torch.int64, device=device)
        self.mask: torch.Tensor | None = None
        # A one-frame step sees all its request's keys; only ragged contexts or multi-frame
        # steps need a mask (keys past a request's frames lie in later blocks, so the same
        # comparison also hides padding).
        lengths = {len(table) for table, _, _ in layout}
        if self.rows != fpt or len(lengths) != 1 or not same:
            key_frame = torch.arange(self.blocks * fpt, device=device) // fpt
            q_frame = torch.tensor(query_frames, device=device)
            self.mask = (key_frame.view(1, 1, -1) <= q_frame.unsqueeze(-1)).unsqueeze(1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attend this layer's queries ``[tokens, heads, dim]``; returns the same shape."""
        cache = self.cache
        cache.write(layer, self.slots, k, v)
        heads, dim = q.shape[1], q.shape[2]
        keys = self._gather(cache.key(layer))
        values = self._gather(cache.value(layer))
        if self.pad_rows is None:
            qp = q.view(self.batch, self.rows, heads, dim)
        else:
            qp = q.new_zeros(self.batch * self.rows, heads, dim)
            qp.index_copy_(0, self.pad_rows, q)
            qp = qp.view(self.batch, self.rows, heads, dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=self.mask
        ).transpose(1, 2)
        flat = out.reshape(self.batch * self.rows, heads, dim)
        return flat if self.pad_rows is None else flat.index_select(0, self.pad_rows)

    def _gather(self, blocks: torch.Tensor) -> torch.Tensor:
        picked = blocks.index_select(0, self.block_index)
        return picked.view(self.batch, -1, *blocks.shape[2:]).transpose(1, 2)


class BlockCausalKVEngine:
    """Runs frame steps of many requests in one forward, keeping each request's K/V.

    The model (a ``FrameModel``) defines the ops and their inputs; the engine owns the paged
    cache (``kv_frames`` frames for all requests together), batching and memory. Admission is
    the shared rule of ``engines/kv/admission.py``: a step that does not fit now waits
    (``WAIT``) while others run; one that could never fit, or the newest of requests that all
    wait on each other, fails with ``KVCacheFull``. ``release`` frees a request's frames
    (finish, error and cancel alike).

    Raises:
        ValueError: ``kv_frames`` is below 1.
    """

    def __init__(
        self,
        model: FrameModel,
        spec: AttentionSpec,
        *,
        num_layers: int,
        kv_frames: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(kv_frames, bool) or not isinstance(kv_frames, int) or kv_frames < 1:
            raise ValueError(f"kv_frames must be a positive int, got {kv_frames!r}")
        self.model = model
        self.device = torch.device(device)
        self.tokens_per_frame = model.tokens_per_frame
        self.allocator = PagedKVAllocator(kv_frames, self.tokens_per_frame)
        self.cache = PagedKVCache(
            num_layers=num_layers,
            num_blocks=kv_frames,
            block_size=self.tokens_per_frame,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            device=self.device,
        )
        self.admission = Admission(
            self.allocator,
            unit="frames",
            tokens_per_unit=self.tokens_per_frame,
            block_word="frames",
            remedy="build the model with a larger kv_frames or ask for a shorter horizon",
        )
        self._pending: dict[str, _Pending] = {}
        # Per request, its latest step launched ahead of its walk and the tokens it held
        # before that step (``discard``).
        self._ahead: dict[str, tuple[Step, int]] = {}

    @property
    def frames_in_use(self) -> int:
        """Frames of KV held by live requests."""
        return self.allocator.num_used_blocks

    def frames_held(self, request_id: str) -> int:
        """Frames cached for ``request_id`` (0 if none)."""
        if not self.allocator.has(request_id):
            return 0
        return self.allocator.num_tokens(request_id) // self.tokens_per_frame

    def cost(self, step: Step) -> int:
        """Tokens the step still has to compute: its new frames' tokens (what is left)."""
        pending = self._pending.get(step.request_id)
        if pending is not None and pending.step is step:
            return max(1, pending.tokens.shape[0])
        return max(1, self.model.new_frames(step) * self.tokens_per_frame)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Compute the new frames of every step that fits, in one model forward. A step the
        model rejects (unknown op, bad inputs) fails alone with its ``EngineError``.

        Raises:
            EngineError: one request appears twice in ``steps``.
        """
        if len({s.request_id for s in steps}) != len(steps):
            raise EngineError("a forward got two steps of one request; submit them in turn")
        results: list[StepResult] = [None] * len(steps)
        chunks = [0] * len(steps)
        valid: list[int] = []
        with torch.inference_mode():
            for i, step in enumerate(steps):
                try:
                    chunks[i] = self._admit(step)
                except EngineError as exc:  # a bad step fails alone (a step run ahead too)
                    results[i] = exc
                else:
                    valid.append(i)
        verdict = self.admission.admit(
            [
                Demand(rid, rid, chunks[i], self._left(steps[i]), steps[i].op)
                for i, rid in ((i, steps[i].request_id) for i in valid)
            ]
        )
        for k, i in enumerate(valid):
            results[i] = verdict.results[k]
        for k in verdict.failed:
            # Its frames will never be computed; the request's held frames go at release.
            self._pending.pop(steps[valid[k]].request_id, None)
        if verdict.admitted:
            with torch.inference_mode():
                outputs = self._run(steps, chunks, [valid[k] for k in verdict.admitted])
            for i, out in outputs.items():
                results[i] = out
        return results

    def export_state(self, request_id: str) -> dict[str, Any] | None:
        """The request's cached frames (K/V on the CPU), to move them to another engine; they
        stay held here until ``release``. ``None`` if nothing is held. Runs on the forward
        thread.

        Raises:
            EngineError: a step of the request is half computed (its frames cannot move).
        """
        if request_id in self._pending:
            raise EngineError(f"request {request_id}: cannot move it while a step is running")
        if not self.allocator.has(request_id):
            return None
        return {"kv": read_sequence(self.allocator, self.cache, request_id)}

    def import_state(self, request_id: str, state: dict[str, Any] | None) -> None:
        """Hold the frames ``export_state`` gave away.

        Raises:
            KVCacheFull: no room for them here (nothing changed).
            EngineError: the request is already held here.
        """
        if state is None:
            return
        if self.allocator.has(request_id):
            raise EngineError(f"request {request_id} is already held by this engine")
        write_sequence(self.allocator, self.cache, request_id, state["kv"])

    def discard(self, step: Step) -> None:
        """Undo a step launched ahead of its walk that the walk did not take (its rollout
        stopped): the frames it added leave the request's cache. A step that never ran here,
        or whose request was released since, changes nothing. Never raises."""
        rid = step.request_id
        ahead = self._ahead.get(rid)
        if ahead is None or ahead[0] is not step:
            return
        del self._ahead[rid]
        pending = self._pending.get(rid)
        if pending is not None and pending.step is step:
            del self._pending[rid]
        if self.allocator.has(rid) and self.allocator.num_tokens(rid) > ahead[1]:
            self.allocator.truncate(rid, ahead[1])

    def release(self, request_id: str) -> None:
        """Free the request's frames and anything pending; idempotent."""
        self._ahead.pop(request_id, None)
        self._pending.pop(request_id, None)
        if self.allocator.has(request_id):
            self.allocator.free(request_id)

    def _admit(self, step: Step) -> int:
        """Tokens this step computes now: whole frames within its budget, at least one."""
        pending = self._pending.get(step.request_id)
        if pending is None or pending.step is not step:
            if step.ahead:
                held = self.frames_held(step.request_id) * self.tokens_per_frame
                self._ahead[step.request_id] = (step, held)
            tokens = self.model.embed(step, self.frames_held(step.request_id))
            if tokens.shape[0] == 0 or tokens.shape[0] % self.tokens_per_frame:
                raise EngineError(
                    f"request {step.request_id}: op {step.op!r} made {tokens.shape[0]} tokens, "
                    f"not a positive multiple of {self.tokens_per_frame} per frame"
                )
            pending = _Pending(step, tokens.to(self.device))
            self._pending[step.request_id] = pending
            if not self.allocator.has(step.request_id):
                self.allocator.add(step.request_id)
        left = pending.tokens.shape[0]
        frames = max(1, step.budget // self.tokens_per_frame) if step.budget else left
        return min(left, frames * self.tokens_per_frame)

    def _left(self, step: Step) -> int:
        pending = self._pending[step.request_id]
        return int(pending.tokens.shape[0])

    def _run(
        self, steps: Sequence[Step], chunks: list[int], admitted: list[int]
    ) -> dict[int, dict[str, Any]]:
        plans = self.allocator.append_batch({steps[i].request_id: chunks[i] for i in admitted})
        layout = [(self.allocator.block_table(p.seq_id), p.start, p.num_new_tokens) for p in plans]
        attention = BlockCausalAttention(self.cache, layout, self.device)
        pieces = []
        for i in admitted:
            pending = self._pending[steps[i].request_id]
            pieces.append(pending.tokens[: chunks[i]])
        x = torch.cat(pieces)
        positions = torch.cat([torch.arange(p.start, p.end, device=self.device) for p in plans])
        hidden = self.model.forward(x, positions, attention)
        finishing: list[int] = []
        last: list[torch.Tensor] = []
        end = 0
        for i in admitted:
            rid = steps[i].request_id
            end += chunks[i]
            pending = self._pending[rid]
            pending.tokens = pending.tokens[chunks[i] :]
            if pending.tokens.shape[0] == 0:
                del self._pending[rid]
                finishing.append(i)
                last.append(hidden[end - self.tokens_per_frame : end])
        if not finishing:
            return {}
        outputs = self.model.finish([steps[i] for i in finishing], torch.stack(last))
        return dict(zip(finishing, outputs, strict=True))
