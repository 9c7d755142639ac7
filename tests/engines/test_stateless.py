"""StatelessEngine: stacking, padding with lengths, op grouping, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_async.engines import StatelessEngine, Step
from mstar_async.errors import EngineError


def steps(op: str, *inputs: dict[str, Any]) -> list[Step]:
    return [Step(f"r{i}", op, x) for i, x in enumerate(inputs)]


def test_same_shaped_tensors_are_stacked_into_one_call() -> None:
    calls: list[tuple[int, ...]] = []

    def double(x: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(tuple(x.shape))
        return {"y": 2 * x}

    engine = StatelessEngine({"double": double})
    out = engine.forward(steps("double", {"x": torch.ones(3)}, {"x": torch.zeros(3)}))
    assert calls == [(2, 3)]
    assert torch.equal(out[0]["y"], torch.full((3,), 2.0))  # type: ignore[index]
    assert torch.equal(out[1]["y"], torch.zeros(3))  # type: ignore[index]


def test_ragged_tensors_arrive_as_a_list_unless_padded() -> None:
    seen: dict[str, Any] = {}

    def total(x: Any, x_lengths: Any = None) -> dict[str, Any]:
        seen["x"], seen["lengths"] = x, x_lengths
        if x_lengths is None:
            return {"sum": [t.sum() for t in x]}
        mask = torch.arange(x.shape[1]) < x_lengths.unsqueeze(1)
        return {"sum": (x * mask).sum(1)}

    batch = steps("sum", {"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([5.0, 5.0, 5.0])})
    listed = StatelessEngine({"sum": total}).forward(batch)
    assert isinstance(seen["x"], list) and seen["lengths"] is None
    padded = StatelessEngine({"sum": total}, pad={"x": -1.0}).forward(batch)
    assert torch.equal(seen["x"], torch.tensor([[1.0, 2.0, -1.0], [5.0, 5.0, 5.0]]))
    assert seen["lengths"].tolist() == [2, 3]
    assert [float(r["sum"]) for r in listed] == [float(r["sum"]) for r in padded] == [3.0, 15.0]  # type: ignore[index]


def test_steps_of_different_ops_run_one_call_per_op_in_order() -> None:
    engine = StatelessEngine({"a": lambda x: {"y": x + 1}, "b": lambda x: {"y": x * 10}})
    out = engine.forward(
        [
            Step("1", "a", {"x": torch.tensor(1)}),
            Step("2", "b", {"x": torch.tensor(2)}),
            Step("3", "a", {"x": torch.tensor(3)}),
        ]
    )
    assert [int(r["y"]) for r in out] == [2, 20, 4]  # type: ignore[index]


def test_dtype_option_casts_floating_inputs_only() -> None:
    seen: dict[str, torch.dtype] = {}

    def op(x: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        seen["x"], seen["ids"] = x.dtype, ids.dtype
        return {"y": x}

    StatelessEngine({"op": op}, dtype=torch.bfloat16).forward(
        steps("op", {"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})
    )
    assert seen == {"x": torch.bfloat16, "ids": torch.long}


def test_errors_name_the_problem() -> None:
    engine = StatelessEngine({"op": lambda x: {"y": x[:1]}})
    with pytest.raises(EngineError, match="has no op 'nope'"):
        engine.forward(steps("nope", {"x": torch.ones(1)}))
    with pytest.raises(EngineError, match="steps disagree on inputs"):
        engine.forward(
            [Step("1", "op", {"x": torch.ones(1)}), Step("2", "op", {"z": torch.ones(1)})]
        )
    with pytest.raises(EngineError, match="output 'y' has 1 entries for 2 steps"):
        engine.forward(steps("op", {"x": torch.ones(1)}, {"x": torch.ones(1)}))
    with pytest.raises(ValueError, match="ops must name at least one op"):
        StatelessEngine({})


def test_cost_counts_the_tokens_an_op_declares_and_one_otherwise() -> None:
    def ident(x: Any) -> dict[str, Any]:
        return {"y": x}

    engine = StatelessEngine({"decode": ident, "other": ident}, tokens={"decode": len_of_codes})
    assert engine.cost(Step("r", "decode", {"codes": torch.zeros(28, 7)})) == 28
    assert engine.cost(Step("r", "other", {"codes": torch.zeros(28, 7)})) == 1


def len_of_codes(inputs: Any) -> int:
    return int(inputs["codes"].shape[0])
