"""``StatelessEngine``: batches steps of a function or module that keeps no per-request state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mstar_async.engines.base import Step, StepResult, group_by_op
from mstar_async.errors import EngineError

#: An op: takes batched inputs by port name and returns batched outputs by port name. A tensor
#: input arrives stacked along a new dim 0 when every step's tensor has the same shape, and as a
#: list of per-step values otherwise (chunks, numbers, ragged tensors). Each output is a tensor
#: (or list) with one entry per step along dim 0.
Op = Callable[..., Mapping[str, Any]]

#: How many tokens one step of an op processes, from its inputs (for the scheduler's budget).
TokenCount = Callable[[Mapping[str, Any]], int]


class StatelessEngine:
    """Runs stateless ops in batches: stacks same-shaped tensor inputs, lists the rest.

    ``ops`` maps op names to callables (an ``nn.Module`` is a callable). Floating tensors are
    moved to ``device``/``dtype`` before the call. Steps of different ops in one forward run as
    one call per op. It holds no per-request state, so ``release`` does nothing.

    ``pad`` names inputs whose tensors may differ in length along dim 0 (token sequences,
    windows of codes): they are right-padded with the given value and stacked, and the op also
    receives ``<name>_lengths``, a long tensor of the true lengths, to build its mask from.

    ``tokens`` maps an op to how many tokens one of its steps processes (from the step's
    inputs), so the scheduler's token budget and forward-time bound count it; an op not named
    there costs 1 per step. A step always runs whole: a stateless op cannot be split.

    Raises:
        ValueError: ``ops`` is empty.
    """

    stateless_steps = True  # a step run ahead and dropped leaves nothing behind

    def __init__(
        self,
        ops: Mapping[str, Op],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        pad: Mapping[str, float] | None = None,
        tokens: Mapping[str, TokenCount] | None = None,
    ) -> None:
        if not ops:
            raise ValueError("StatelessEngine: ops must name at least one op")
        self.ops = dict(ops)
        self.tokens = dict(tokens or {})
        self.pad = dict(pad or {})
        self.device = torch.device(device)
        self.dtype = dtype

    def cost(self, step: Step) -> int:
        """The tokens the op's ``tokens`` entry counts for this step (at least 1), else 1.

        Raises:
            what the op's token count raises for bad inputs.
        """
        count = self.tokens.get(step.op)
        return 1 if count is None else max(1, int(count(step.inputs)))

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """Run each op once over all of its steps in ``steps``.

        Raises:
            EngineError: an op is unknown, steps disagree on their input names, or an op's
                outputs do not have one entry per step.
        """
        results: list[StepResult] = [None] * len(steps)
        for op, indices in group_by_op(steps).items():
            outputs = self.run_op(op, [steps[i].inputs for i in indices])
            for i, output in zip(indices, outputs, strict=True):
                results[i] = output
        return results

    def run_op(self, op: str, batch: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Run ``op`` on the inputs of several steps at once; one output mapping per step.

        Raises:
            EngineError: as ``forward``.
        """
        fn = self.ops.get(op)
        if fn is None:
            raise EngineError(f"StatelessEngine has no op {op!r}; ops: {sorted(self.ops)}")
        names = set(batch[0])
        for inputs in batch:
            if set(inputs) != names:
                raise EngineError(
                    f"op {op!r}: steps disagree on inputs ({sorted(names)} vs {sorted(inputs)})"
                )
        collated: dict[str, Any] = {}
        for name in names:
            values = [inputs[name] for inputs in batch]
            if name in self.pad:
                collated[name], collated[f"{name}_lengths"] = self._pad(name, values)
            else:
                collated[name] = self._collate(values)
        with torch.inference_mode():
            outputs = fn(**collated)
        return _split(op, outputs, len(batch))

    def release(self, request_id: str) -> None:
        """Nothing to release: the engine keeps no per-request state."""

    def _collate(self, values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor) and all(
            isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        ):
            return self._place(torch.stack(values))
        return [self._place(v) if isinstance(v, torch.Tensor) else v for v in values]

    def _pad(self, name: str, values: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
            raise EngineError(
                f"input {name!r} is padded, so every step must give a tensor of dim >= 1"
            )
        tensors: list[torch.Tensor] = values
        lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
        longest = int(lengths.max())
        padded = tensors[0].new_full((len(tensors), longest, *tensors[0].shape[1:]), self.pad[name])
        for i, tensor in enumerate(tensors):
            padded[i, : tensor.shape[0]] = tensor
        return self._place(padded), lengths.to(self.device)

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        return tensor.to(device=self.device, dtype=dtype)


def _split(op: str, outputs: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    per_step: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, value in outputs.items():
        if len(value) != n:
            raise EngineError(f"op {op!r}: output {name!r} has {len(value)} entries for {n} steps")
        for i in range(n):
            per_step[i][name] = value[i]
    return per_step
