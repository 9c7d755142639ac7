"""The Chunk value type."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_async.policies import Chunk


def test_conveniences() -> None:
    chunk = Chunk([5, 6, 7, 8], start=5, context=3)
    assert chunk.new == [8]
    assert chunk.end == 9
    assert len(chunk) == 4
    assert chunk.final is False
    assert chunk.lookahead == 0


def test_new_excludes_context_and_look_ahead() -> None:
    chunk = Chunk(list(range(10, 20)), start=10, context=3, lookahead=4)
    assert chunk.new == [13, 14, 15]
    assert chunk.end == 20
    data = torch.arange(12).reshape(6, 2)
    ahead = Chunk(data, start=0, context=0, lookahead=6)
    assert ahead.new.shape == (0, 2)  # type: ignore[union-attr]
    assert Chunk([], start=5, final=True).new == []


def test_new_on_a_tensor_is_the_tail_rows() -> None:
    data = torch.arange(6).reshape(3, 2)
    chunk = Chunk(data, start=2, context=1, final=True)
    assert torch.equal(chunk.new, data[1:])  # type: ignore[arg-type]
    assert (len(chunk), chunk.end) == (3, 5)


def test_frozen_with_slots() -> None:
    chunk = Chunk([1], start=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.start = 1  # type: ignore[misc]
    assert not hasattr(chunk, "__dict__")


def test_equality_compares_contents_positions_and_flags() -> None:
    t = torch.ones(2, 3)
    assert Chunk(t, 0) == Chunk(t.clone(), 0)
    assert Chunk(t, 0) != Chunk(t, 1)
    assert Chunk(t, 0) != Chunk(t, 0, final=True)
    assert Chunk(t, 0, 1) != Chunk(t, 0, 1, 1)
    assert Chunk(t, 0) != Chunk(t.to(torch.float64), 0)
    assert Chunk(t, 0) != Chunk(torch.ones(2, 2), 0)
    assert Chunk([1.0, 1.0], 0) != Chunk(torch.ones(2), 0)
    assert Chunk([1, 2], 0, 1) == Chunk([1, 2], 0, 1)
    assert Chunk([1, 2], 0) != "Chunk"


def test_repr_is_short() -> None:
    assert repr(Chunk([1, 2], start=3, context=1)) == (
        "Chunk(start=3, end=5, context=1, lookahead=0, final=False, data=[1, 2])"
    )
    assert repr(Chunk(list(range(30)), start=0)) == (
        "Chunk(start=0, end=30, context=0, lookahead=0, final=False, data=<list of 30 items>)"
    )
    assert repr(Chunk(torch.zeros(28, 7), start=0, final=True)) == (
        "Chunk(start=0, end=28, context=0, lookahead=0, final=True, "
        "data=<tensor [28, 7] torch.float32>)"
    )


@pytest.mark.parametrize(
    ("start", "context", "lookahead", "match"),
    [
        (-1, 0, 0, "start must be >= 0, got -1"),
        (0, 3, 0, r"context \+ lookahead <= len\(data\)=2, got 3 and 0"),
        (0, 1, 2, r"context \+ lookahead <= len\(data\)=2, got 1 and 2"),
        (0, 0, -1, r"must be >= 0 .* got 0 and -1"),
        (0, -1, 0, r"must be >= 0 .* got -1 and 0"),
    ],
)
def test_bad_positions_raise(start: int, context: int, lookahead: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Chunk([1, 2], start=start, context=context, lookahead=lookahead)
