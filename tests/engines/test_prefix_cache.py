"""PrefixCacheEngine: per-request prefixes held until release, suffix steps batched with masks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines import WAIT, Step
from mstar_async.engines.prefix_cache import (
    PaddedPrefixes,
    PrefixCacheEngine,
    PrefixKV,
    pad_prefixes,
)
from mstar_async.errors import EngineError

pytestmark = pytest.mark.timeout(30)


def prefix_of(length: int, layers: int = 2, fill: float = 1.0) -> PrefixKV:
    keys = tuple(torch.full((1, length, 4), fill + i) for i in range(layers))
    values = tuple(torch.full((1, length, 4), -fill - i) for i in range(layers))
    return PrefixKV(keys, values)


class SumModel:
    """A prefix is its tokens as keys; ``total`` sums a request's valid prefix keys."""

    suffix_ops = frozenset({"total"})
    device = torch.device("cpu")

    def step_tokens(self, op: str, inputs: Mapping[str, Any]) -> int:
        return int(inputs["tokens"].shape[0]) if op == "prefix" else 1

    def encode_prefix(self, batch: Sequence[Mapping[str, Any]]) -> list[PrefixKV]:
        out = []
        for inputs in batch:
            tokens = inputs["tokens"].to(torch.float32).view(1, -1, 1).expand(1, -1, 4)
            out.append(PrefixKV((tokens.clone(),), (tokens.clone(),)))
        return out

    def run_suffix(
        self, op: str, batch: Sequence[Mapping[str, Any]], prefixes: PaddedPrefixes
    ) -> list[dict[str, Any]]:
        keys = prefixes.keys[0][:, 0, :, 0]
        valid = torch.arange(keys.shape[1]) < prefixes.lengths.unsqueeze(1)
        sums = (keys * valid).sum(1)
        return [{"total": s + inputs["add"]} for s, inputs in zip(sums, batch, strict=True)]


def prefix_step(rid: str, *tokens: int) -> Step:
    return Step(rid, "prefix", {"tokens": torch.tensor(tokens)})


def test_suffix_steps_of_different_prefix_lengths_batch_in_one_call() -> None:
    engine = PrefixCacheEngine(SumModel())
    out = engine.forward([prefix_step("a", 1, 2, 3), prefix_step("b", 10)])
    assert [int(o["length"]) for o in out] == [3, 1]  # type: ignore[index]
    out = engine.forward([Step("a", "total", {"add": 100}), Step("b", "total", {"add": 0})])
    assert [int(o["total"]) for o in out] == [106, 10]  # type: ignore[index]
    assert engine.suffix_batches == {2: 1} and engine.requests_held == 2


def test_release_frees_and_a_later_suffix_step_fails_alone() -> None:
    engine = PrefixCacheEngine(SumModel())
    engine.forward([prefix_step("a", 1), prefix_step("b", 2)])
    assert engine.bytes_held == 2 * 2 * 4 * 4
    engine.release("a")
    engine.release("a")  # idempotent
    out = engine.forward([Step("a", "total", {"add": 0}), Step("b", "total", {"add": 0})])
    assert isinstance(out[0], EngineError) and "has no prefix" in str(out[0])
    assert int(out[1]["total"]) == 2  # type: ignore[index]
    engine.release("b")
    assert engine.requests_held == 0 and engine.bytes_held == 0


def test_export_moves_a_prefix_to_another_engine() -> None:
    source, target = PrefixCacheEngine(SumModel()), PrefixCacheEngine(SumModel())
    source.forward([prefix_step("a", 1, 2, 3)])
    state = source.export_state("a")
    assert source.requests_held == 1  # held until released, once the state has arrived
    source.release("a")
    assert source.requests_held == 0 and source.export_state("a") is None
    assert state is not None and state["keys"].shape == (1, 1, 3, 4)
    target.import_state("a", state)
    target.import_state("b", None)  # nothing held on the source: nothing to import
    assert target.requests_held == 1
    assert int(target.forward([Step("a", "total", {"add": 0})])[0]["total"]) == 6  # type: ignore[index]
    with pytest.raises(EngineError, match="already held"):
        target.import_state("a", state)


def test_cost_is_the_tokens_the_model_counts() -> None:
    engine = PrefixCacheEngine(SumModel())
    assert engine.cost(prefix_step("a", *range(1000))) == 1000
    assert engine.cost(Step("a", "total", {"add": 0})) == 1


def test_a_second_prefix_replaces_the_first() -> None:
    engine = PrefixCacheEngine(SumModel(), max_requests=1)
    engine.forward([prefix_step("a", 1, 1)])
    engine.forward([prefix_step("a", 5)])  # the same request fits again
    assert engine.requests_held == 1
    assert int(engine.forward([Step("a", "total", {"add": 0})])[0]["total"]) == 5  # type: ignore[index]


def test_prefixes_beyond_max_requests_wait_until_a_release() -> None:
    engine = PrefixCacheEngine(SumModel(), max_requests=2)
    out = engine.forward([prefix_step(r, 1) for r in "abc"])
    assert out[2] is WAIT and out[0] is not WAIT and out[1] is not WAIT
    engine.release("a")
    assert engine.forward([prefix_step("c", 1)])[0] is not WAIT
    assert engine.peak_requests == 2


def test_unknown_op_and_bad_settings_are_named() -> None:
    with pytest.raises(EngineError, match="no op 'nope'"):
        PrefixCacheEngine(SumModel()).forward([Step("a", "nope", {})])
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        PrefixCacheEngine(SumModel(), max_requests=0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(1, 3))
def test_padding_keeps_each_prefix_and_zeros_the_rest(lengths: list[int], layers: int) -> None:
    prefixes = [prefix_of(n, layers, fill=i + 1) for i, n in enumerate(lengths)]
    padded = pad_prefixes(prefixes)
    assert padded.lengths.tolist() == lengths
    for layer in range(layers):
        keys, values = padded.keys[layer], padded.values[layer]
        assert keys.shape == (len(lengths), 1, max(lengths), 4)
        for i, (p, n) in enumerate(zip(prefixes, lengths, strict=True)):
            assert torch.equal(keys[i, :, :n], p.keys[layer])
            assert torch.equal(values[i, :, :n], p.values[layer])
            assert not keys[i, :, n:].any() and not values[i, :, n:].any()
