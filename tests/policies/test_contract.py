"""The ChunkPolicy contract shared by every policy: arguments, kinds, closing, fresh, equality."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_async.errors import MstarError, PolicyError
from mstar_async.policies import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

POLICIES = [
    pytest.param(lambda: FixedChunkPolicy(3), id="fixed"),
    pytest.param(lambda: SlidingWindowChunkPolicy(4, 2), id="sliding"),
    pytest.param(lambda: LeftContextChunkPolicy(3, 2), id="left_context"),
    pytest.param(lambda: LeftContextChunkPolicy(3, 2, 2), id="lookahead"),
]
CLOSED = r"policy already closed; create a fresh policy per stream with \.fresh\(\)"


# --- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (FixedChunkPolicy, {"size": 0}, "FixedChunkPolicy: size must be an int >= 1, got 0"),
        (FixedChunkPolicy, {"size": -3}, "FixedChunkPolicy: size must be an int >= 1, got -3"),
        (FixedChunkPolicy, {"size": 2.0}, "size must be an int >= 1, got 2.0 (float)"),
        (FixedChunkPolicy, {"size": True}, "size must be an int >= 1, got True (bool)"),
        (FixedChunkPolicy, {"size": "4"}, "size must be an int >= 1, got '4' (str)"),
        (
            SlidingWindowChunkPolicy,
            {"window": 4, "stride": 5},
            "SlidingWindowChunkPolicy: stride must be an int in [1, window=4], got 5",
        ),
        (
            SlidingWindowChunkPolicy,
            {"window": 4, "stride": 0},
            "stride must be an int in [1, window=4], got 0",
        ),
        (
            SlidingWindowChunkPolicy,
            {"window": 0, "stride": 1},
            "SlidingWindowChunkPolicy: window must be an int >= 1, got 0",
        ),
        (
            SlidingWindowChunkPolicy,
            {"window": 4.0, "stride": 1},
            "window must be an int >= 1, got 4.0 (float)",
        ),
        (
            SlidingWindowChunkPolicy,
            {"window": 4, "stride": False},
            "stride must be an int in [1, window=4], got False (bool)",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": 0, "left_context": 1},
            "LeftContextChunkPolicy: chunk must be an int >= 1, got 0",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": 2, "left_context": -1},
            "LeftContextChunkPolicy: left_context must be an int >= 0, got -1",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": 2, "left_context": 1.5},
            "left_context must be an int >= 0, got 1.5 (float)",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": None, "left_context": 1},
            "chunk must be an int >= 1, got None (NoneType)",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": 2, "left_context": 1, "lookahead": -1},
            "LeftContextChunkPolicy: lookahead must be an int >= 0, got -1",
        ),
        (
            LeftContextChunkPolicy,
            {"chunk": 2, "left_context": 1, "lookahead": 1.0},
            "lookahead must be an int >= 0, got 1.0 (float)",
        ),
    ],
)
def test_bad_arguments_name_the_argument_and_range(
    cls: type[ChunkPolicy], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert message in str(info.value)


def test_edge_arguments_are_accepted() -> None:
    assert SlidingWindowChunkPolicy(1, 1).params == {"window": 1, "stride": 1}
    assert SlidingWindowChunkPolicy(5, 5).stride == 5
    assert LeftContextChunkPolicy(1, 0).left_context == 0
    assert LeftContextChunkPolicy(1, 0).lookahead == 0
    assert LeftContextChunkPolicy(1, 0, 3).params == {"chunk": 1, "left_context": 0, "lookahead": 3}
    assert FixedChunkPolicy(1).size == 1


# --- kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", POLICIES)
def test_tensor_after_list_raises(make: Any) -> None:
    policy = make()
    policy.push([1])
    with pytest.raises(PolicyError, match=r"expected a list .* got a tensor of shape \[\*, 2\]"):
        policy.push(torch.zeros(1, 2))
    # Even an empty tensor is the other kind; only an empty list is kind-neutral.
    with pytest.raises(PolicyError, match="expected a list"):
        policy.push(torch.zeros(0))


@pytest.mark.parametrize("make", POLICIES)
def test_list_after_tensor_raises(make: Any) -> None:
    policy = make()
    policy.push(torch.zeros(1, 2))
    with pytest.raises(PolicyError, match=r"expected a tensor of shape \[\*, 2\] .* got a list"):
        policy.push([1])


@pytest.mark.parametrize("make", POLICIES)
def test_tensor_with_other_trailing_shape_or_dtype_raises(make: Any) -> None:
    policy = make()
    policy.push(torch.zeros(2, 3))
    with pytest.raises(PolicyError) as info:
        policy.push(torch.zeros(1, 4))
    assert "expected a tensor of shape [*, 3] dtype torch.float32" in str(info.value)
    assert "got a tensor of shape [*, 4] dtype torch.float32" in str(info.value)
    with pytest.raises(PolicyError, match=r"dtype torch\.float32 .* got .* dtype torch\.int64"):
        policy.push(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(PolicyError, match=r"got a tensor of shape \[\*, 3, 1\]"):
        policy.push(torch.zeros(1, 3, 1))
    with pytest.raises(PolicyError, match="got a 0-d tensor"):
        policy.push(torch.tensor(1.0))


@pytest.mark.parametrize("make", POLICIES)
def test_a_failed_push_leaves_the_policy_unchanged(make: Any) -> None:
    stream = list(range(11))
    reference = make()
    expected = reference.push(stream[:5]) + reference.push(stream[5:]) + reference.close()
    policy = make()
    got = policy.push(stream[:5])
    with pytest.raises(PolicyError):
        policy.push(torch.zeros(3))
    assert policy.pushed == 5
    got += policy.push(stream[5:]) + policy.close()
    assert got == expected


@pytest.mark.parametrize("make", POLICIES)
def test_empty_pushes_are_accepted_for_either_kind(make: Any) -> None:
    tensors = make()
    assert tensors.push(torch.zeros(0, 2)) == []  # does not fix the kind yet
    assert tensors.push([]) == []
    tensors.push(torch.zeros(2, 2))
    assert tensors.push([]) == []
    assert tensors.push(torch.zeros(0, 2)) == []
    assert tensors.pushed == 2

    lists = make()
    assert lists.push(torch.zeros(0, 5)) == []
    lists.push([1, 2])
    assert lists.push([]) == []
    assert lists.pushed == 2


@pytest.mark.parametrize("make", POLICIES)
@pytest.mark.parametrize("items", [(1, 2), "ab", torch.tensor(3), 5, None], ids=repr)
def test_items_must_be_a_list_or_tensor(make: Any, items: Any) -> None:
    with pytest.raises(PolicyError, match="push takes a list of items or a tensor"):
        make().push(items)


# --- closing -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", POLICIES)
def test_push_after_close_raises(make: Any) -> None:
    policy = make()
    policy.push([1, 2])
    policy.close()
    for items in ([3], [], torch.zeros(1, 1)):
        with pytest.raises(PolicyError, match=CLOSED):
            policy.push(items)


@pytest.mark.parametrize("make", POLICIES)
def test_close_twice_raises(make: Any) -> None:
    policy = make()
    assert policy.close() == [Chunk([], start=0, final=True)]
    assert policy.closed
    with pytest.raises(PolicyError, match=CLOSED) as info:
        policy.close()
    assert isinstance(info.value, MstarError)
    assert repr(policy) in str(info.value)


@pytest.mark.parametrize("make", POLICIES)
def test_close_releases_everything(make: Any) -> None:
    policy = make()
    policy.push(list(range(7)))
    assert policy.buffered > 0
    *_, tail = policy.close()
    assert tail.final
    assert policy.buffered == 0
    assert policy.pushed == 7


# --- fresh, equality, repr -----------------------------------------------------------------


@pytest.mark.parametrize("make", POLICIES)
def test_fresh_is_an_equal_independent_unused_policy(make: Any) -> None:
    template = make()
    first = template.fresh()
    assert type(first) is type(template)
    assert first == template and hash(first) == hash(template)
    assert first is not template

    first.push(list(range(5)))
    second = first.fresh()
    assert (second.pushed, second.buffered, second.closed) == (0, 0, False)
    assert second.push(list(range(5))) == template.fresh().push(list(range(5)))
    first.close()
    assert not template.closed and template.pushed == 0
    assert first.fresh().push(torch.zeros(1, 2)) is not None  # fresh kind, not closed


def test_equality_is_on_type_and_parameters() -> None:
    assert FixedChunkPolicy(3) == FixedChunkPolicy(3)
    assert FixedChunkPolicy(3) != FixedChunkPolicy(4)
    assert SlidingWindowChunkPolicy(4, 2) != SlidingWindowChunkPolicy(4, 1)
    assert LeftContextChunkPolicy(3, 3) != SlidingWindowChunkPolicy(3, 3)
    assert LeftContextChunkPolicy(3, 3) == LeftContextChunkPolicy(3, 3, 0)
    assert LeftContextChunkPolicy(3, 3) != LeftContextChunkPolicy(3, 3, 1)
    assert FixedChunkPolicy(3) != 3
    assert len({FixedChunkPolicy(3), FixedChunkPolicy(3), LeftContextChunkPolicy(3, 0)}) == 2


def test_repr_shows_the_parameters() -> None:
    assert repr(SlidingWindowChunkPolicy(window=28, stride=7)) == (
        "SlidingWindowChunkPolicy(window=28, stride=7)"
    )
    assert repr(FixedChunkPolicy(4)) == "FixedChunkPolicy(size=4)"
    assert repr(LeftContextChunkPolicy(25, 25)) == (
        "LeftContextChunkPolicy(chunk=25, left_context=25, lookahead=0)"
    )


def test_chunk_policy_is_abstract() -> None:
    with pytest.raises(TypeError):
        ChunkPolicy()  # type: ignore[abstract]


# --- data ownership ------------------------------------------------------------------------


def test_editing_a_tensor_chunk_touches_nothing_else() -> None:
    stream = torch.arange(16.0).reshape(8, 2)
    policy = SlidingWindowChunkPolicy(3, 1)
    chunks = policy.push(stream[:6])
    assert [c.start for c in chunks] == [0, 1, 2, 3]
    for chunk in chunks:
        chunk.data.zero_()  # type: ignore[union-attr]
    assert torch.equal(stream, torch.arange(16.0).reshape(8, 2))
    # The next windows reuse items 4 and 5 as context; they must be intact.
    assert policy.push(stream[6:]) == [
        Chunk(stream[4:7], start=4, context=2),
        Chunk(stream[5:8], start=5, context=2),
    ]


def test_the_final_chunk_of_a_tensor_stream_ending_on_a_boundary_is_an_empty_slice() -> None:
    policy = FixedChunkPolicy(2)
    policy.push(torch.ones(4, 3, dtype=torch.int16))
    [end] = policy.close()
    assert end == Chunk(torch.zeros(0, 3, dtype=torch.int16), start=4, final=True)
    assert len(end.new) == 0


def test_list_chunks_are_new_lists() -> None:
    stream = [0, 1, 2, 3]
    policy = FixedChunkPolicy(4)
    [chunk] = policy.push(stream)
    assert chunk.data == stream and chunk.data is not stream
