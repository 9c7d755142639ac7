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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mstar_async.engines.base import Step, StepResult, group_by_op
from mstar_async.engines.kv import (
    AttentionSpec,
    BatchLayout,
    select_attention_backend,
)
from mstar_async.engines.kv.cache import paged_storage
from mstar_async.engines.kv_engine import StepAttention
from mstar_async.engines.sampling import SamplingParams, make_generator, sample
from mstar_async.errors import EngineError, KVCacheFull

__all__ = ["EmbedsKVEngine", "EmbedsOp", "Sampler"]

_GREEDY = SamplingParams(temperature=0.0)


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
    """

    embed: Callable[[Mapping[str, Any]], torch.Tensor]
    finish: Callable[
        [torch.Tensor, Sequence[Mapping[str, Any]], Sequence[Sampler]],
        list[dict[str, Any]],
    ]
    fresh: bool = False
    cost: Callable[[Mapping[str, Any]], int] = lambda inputs: 1


@dataclass(frozen=True)
class Sampler:
    """A request's sampling parameters and its own random generator."""

    params: SamplingParams
    generator: torch.Generator | None

    def sample(self, logits: torch.Tensor) -> int:
        """Draw one id from a ``[vocab]`` row of logits."""
        return int(sample(logits.float().unsqueeze(0), [self.params], [self.generator])[0])


class EmbedsKVEngine:
    """Runs embedding-fed steps of many requests in one paged-attention forward.

    ``stack(x, attention)`` maps flat rows ``[n, hidden]`` to final hidden states. A request's
    sampling generator comes from the ``sampling`` input (``SamplingParams``) of its first step
    that carries one (greedy otherwise) and lives until ``release``.

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
        block_size: int = 16,
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
        self.stack = stack
        self.ops = dict(ops)
        self._samplers: dict[str, Sampler] = {}

    @property
    def blocks_in_use(self) -> int:
        """KV blocks held by live sequences."""
        return self.allocator.num_used_blocks

    def cost(self, step: Step) -> int:
        """Rows the step feeds (its prompt length, or 1)."""
        op = self.ops.get(step.op)
        return 1 if op is None else max(1, op.cost(step.inputs))

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """One forward over every step that fits in the KV cache.

        A step that does not fit gets a ``KVCacheFull`` result (that request alone fails).

        Raises:
            EngineError: an unknown op, or an op's ``embed`` returning no rows.
        """
        results: list[StepResult] = [None] * len(steps)
        rows: dict[int, torch.Tensor] = {}
        wanted: dict[str, int] = {}
        with torch.inference_mode():
            for i, step in enumerate(steps):
                op = self._op(step.op)
                if op.fresh:
                    self._drop_kv(step.request_id)
                self._start(step)
                x = op.embed(step.inputs)
                if x.dim() != 2 or x.shape[0] == 0:
                    raise EngineError(f"op {step.op!r} embedded its inputs as {tuple(x.shape)}")
                trial = {**wanted, step.request_id: x.shape[0]}
                if not self.allocator.can_append_batch(trial):
                    results[i] = KVCacheFull(
                        f"request {step.request_id}: no KV room for {x.shape[0]} more rows; "
                        "give the engine a larger kv_cache_bytes or lower the concurrency"
                    )
                    continue
                wanted, rows[i] = trial, x
            if rows:
                self._run(steps, rows, results)
        return results

    def release(self, request_id: str) -> None:
        """Free the request's KV blocks and generator; idempotent."""
        self._drop_kv(request_id)
        self._samplers.pop(request_id, None)

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
        self, steps: Sequence[Step], rows: dict[int, torch.Tensor], results: list[StepResult]
    ) -> None:
        order = list(rows)
        plans = self.allocator.append_batch({steps[i].request_id: rows[i].shape[0] for i in order})
        self.cache.copy_blocks([c for plan in plans for c in plan.copies])
        meta = self.backend.plan(BatchLayout.from_plans(self.allocator, plans))
        x = torch.cat([rows[i] for i in order]).to(self.device)
        hidden = self.stack(x, StepAttention(self.cache, self.backend, meta))
        ends = torch.cumsum(torch.tensor([rows[i].shape[0] for i in order]), 0) - 1
        last = {i: hidden[int(end)] for i, end in zip(order, ends, strict=True)}
        admitted = [steps[i] for i in order]
        for op, group in group_by_op(admitted).items():
            chosen = [order[g] for g in group]
            outputs = self._op(op).finish(
                torch.stack([last[i] for i in chosen]),
                [steps[i].inputs for i in chosen],
                [self._samplers[steps[i].request_id] for i in chosen],
            )
            for i, out in zip(chosen, outputs, strict=True):
                results[i] = out
