"""``PrefixCacheEngine``: keeps each request's prefix keys and values, and batches suffix steps
of many requests against them.

A vision-language-action policy encodes its observation once (the *prefix*: image, instruction,
state) and then runs several denoising steps of an action expert that attend to that prefix.
The engine holds one ``PrefixKV`` per request, built by the ``prefix`` op and dropped by
``release``; every suffix op of a forward batches all its requests in one call, their prefixes
right-padded to the longest with the true lengths passed along for the attention mask.

Why dense per-request tensors rather than pages: a prefix is written once and never grows, so
there is no fragmentation for pages to fix, and a dense [kv_heads, length, dim] per layer pads
into a batch with one copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mstar_async.engines.base import WAIT, Step, StepResult, group_by_op
from mstar_async.errors import EngineError

PREFIX_OP = "prefix"


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """One request's prefix: per layer, keys and values [kv_heads, length, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        """Tokens in the prefix."""
        return int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes the keys and values take."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True, slots=True)
class PaddedPrefixes:
    """Prefixes of a batch: per layer [batch, kv_heads, longest, head_dim], and true lengths."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    lengths: torch.Tensor


def pad_prefixes(prefixes: Sequence[PrefixKV]) -> PaddedPrefixes:
    """Right-pad the prefixes of a batch to the longest (padding is zeros; mask it by length).

    Raises:
        ValueError: ``prefixes`` is empty or their layer counts differ.
    """
    if not prefixes or len({len(p.keys) for p in prefixes}) != 1:
        raise ValueError("pad_prefixes needs one or more prefixes with the same layer count")
    lengths = [p.length for p in prefixes]
    longest = max(lengths)

    def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        first = tensors[0]
        out = first.new_zeros((len(tensors), first.shape[0], longest, first.shape[2]))
        for i, t in enumerate(tensors):
            out[i, :, : t.shape[1]] = t
        return out

    layers = range(len(prefixes[0].keys))
    return PaddedPrefixes(
        keys=tuple(stack([p.keys[i] for p in prefixes]) for i in layers),
        values=tuple(stack([p.values[i] for p in prefixes]) for i in layers),
        lengths=torch.tensor(lengths, dtype=torch.long, device=prefixes[0].keys[0].device),
    )


class PrefixModel(Protocol):
    """What the engine needs of a model: encode prefixes, and run suffix ops against them."""

    #: The ops besides ``prefix`` that the model runs against a cached prefix.
    suffix_ops: frozenset[str]

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live (an imported prefix is moved there)."""
        ...

    def step_tokens(self, op: str, inputs: Mapping[str, Any]) -> int:
        """Tokens one step of ``op`` (``prefix`` or a suffix op) with these inputs runs: the
        scheduler's token budget and forward-time bound count them."""
        ...

    def encode_prefix(self, batch: Sequence[Mapping[str, Any]]) -> list[PrefixKV]:
        """One ``PrefixKV`` per step's inputs."""
        ...

    def run_suffix(
        self, op: str, batch: Sequence[Mapping[str, Any]], prefixes: PaddedPrefixes
    ) -> list[dict[str, Any]]:
        """Run ``op`` for a batch of steps against their padded prefixes; outputs per step."""
        ...


class PrefixCacheEngine:
    """Runs ``prefix`` steps (keeping each request's prefix) and batched suffix steps.

    Ops: ``prefix`` (the model's prefix inputs -> ``length``, a 0-dim long tensor; a second
    prefix of the same request replaces the first) and each of ``model.suffix_ops`` (the
    model's inputs -> its outputs; a request without a prefix fails that step alone).
    ``max_requests`` bounds how many prefixes are held: a prefix step beyond it waits (the
    scheduler parks it) until some request releases its own.

    Raises:
        ValueError: ``max_requests`` is below 1, or a suffix op is called ``prefix``.
    """

    def __init__(self, model: PrefixModel, *, max_requests: int | None = None) -> None:
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1 (or None), got {max_requests}")
        if PREFIX_OP in model.suffix_ops:
            raise ValueError(f"a suffix op may not be called {PREFIX_OP!r}")
        self.model = model
        self.max_requests = max_requests
        self._prefixes: dict[str, PrefixKV] = {}
        #: Steps served, by op; and how many suffix forwards had each batch size.
        self.served: Counter[str] = Counter()
        self.suffix_batches: Counter[int] = Counter()
        #: The most prefixes held at once.
        self.peak_requests = 0

    @property
    def requests_held(self) -> int:
        """Requests whose prefix the engine holds."""
        return len(self._prefixes)

    @property
    def bytes_held(self) -> int:
        """Bytes of all the prefixes held."""
        return sum(p.nbytes for p in self._prefixes.values())

    def prefix_of(self, request_id: str) -> PrefixKV | None:
        """The prefix held for ``request_id``, if any."""
        return self._prefixes.get(request_id)

    def cost(self, step: Step) -> int:
        """The tokens the model counts for the step (its prefix, or its suffix tokens); a
        step always runs whole, in one forward.

        Raises:
            what the model's ``step_tokens`` raises for bad inputs.
        """
        return max(1, int(self.model.step_tokens(step.op, step.inputs)))

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Run each op once over its steps of this forward.

        Raises:
            EngineError: an op is unknown, or the model returned the wrong number of outputs.
        """
        results: list[StepResult] = [None] * len(steps)
        with torch.inference_mode():
            for op, indices in group_by_op(steps).items():
                chosen = [steps[i] for i in indices]
                if op == PREFIX_OP:
                    outputs = self._prefix(chosen)
                elif op in self.model.suffix_ops:
                    outputs = self._suffix(op, chosen)
                else:
                    ops = sorted({PREFIX_OP, *self.model.suffix_ops})
                    raise EngineError(f"PrefixCacheEngine has no op {op!r}; ops: {ops}")
                for i, out in zip(indices, outputs, strict=True):
                    results[i] = out
        return results

    def release(self, request_id: str) -> None:
        """Drop the prefix of ``request_id``; idempotent."""
        self._prefixes.pop(request_id, None)

    def export_state(self, request_id: str) -> dict[str, torch.Tensor] | None:
        """The prefix of ``request_id`` as CPU tensors [layers, kv_heads, length, dim], to move
        it to another engine (prefix on one rank, the action loop on another); it stays held
        here until ``release``. ``None`` if nothing is held. Never raises."""
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            return None
        return {
            "keys": torch.stack(prefix.keys).cpu(),
            "values": torch.stack(prefix.values).cpu(),
        }

    def import_state(self, request_id: str, state: dict[str, torch.Tensor] | None) -> None:
        """Hold the prefix that ``export_state`` gave away, on this engine's device.

        Raises:
            EngineError: the request is already held here.
        """
        if state is None:
            return
        if request_id in self._prefixes:
            raise EngineError(f"request {request_id} is already held by this engine")
        device = self.model.device
        keys, values = state["keys"].to(device), state["values"].to(device)
        self._prefixes[request_id] = PrefixKV(tuple(keys.unbind(0)), tuple(values.unbind(0)))
        self.peak_requests = max(self.peak_requests, len(self._prefixes))

    def _prefix(self, steps: Sequence[Step]) -> list[StepResult]:
        results: list[StepResult] = [WAIT] * len(steps)
        admitted: list[int] = []
        room = None if self.max_requests is None else self.max_requests - len(self._prefixes)
        for i, step in enumerate(steps):
            if step.request_id in self._prefixes or room is None or room > 0:
                admitted.append(i)
                if step.request_id not in self._prefixes and room is not None:
                    room -= 1
        if not admitted:
            return results
        encoded = self.model.encode_prefix([steps[i].inputs for i in admitted])
        if len(encoded) != len(admitted):
            raise EngineError(
                f"encode_prefix gave {len(encoded)} prefixes for {len(admitted)} steps"
            )
        for i, prefix in zip(admitted, encoded, strict=True):
            self._prefixes[steps[i].request_id] = prefix
            results[i] = {"length": torch.tensor(prefix.length)}
        self.peak_requests = max(self.peak_requests, len(self._prefixes))
        self.served[PREFIX_OP] += len(admitted)
        return results

    def _suffix(self, op: str, steps: Sequence[Step]) -> list[StepResult]:
        results: list[StepResult] = [None] * len(steps)
        ready: list[int] = []
        for i, step in enumerate(steps):
            if step.request_id in self._prefixes:
                ready.append(i)
            else:
                results[i] = EngineError(
                    f"op {op!r} of request {step.request_id!r} has no prefix: run the "
                    f"{PREFIX_OP!r} op for the request first (or it was released)"
                )
        if ready:
            prefixes = pad_prefixes([self._prefixes[steps[i].request_id] for i in ready])
            outputs = self.model.run_suffix(op, [steps[i].inputs for i in ready], prefixes)
            if len(outputs) != len(ready):
                raise EngineError(f"op {op!r} gave {len(outputs)} outputs for {len(ready)} steps")
            for i, out in zip(ready, outputs, strict=True):
                results[i] = out
            self.served[op] += len(ready)
            self.suffix_batches[len(ready)] += 1
        return results


__all__ = [
    "PREFIX_OP",
    "PaddedPrefixes",
    "PrefixCacheEngine",
    "PrefixKV",
    "PrefixModel",
    "pad_prefixes",
]
