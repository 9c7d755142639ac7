"""The item buffers behind the policies: slicing by stream index, releasing, compaction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.errors import PolicyError
from mstar_async.policies.buffer import ItemBuffer, ListBuffer, TensorBuffer, new_buffer

from .support import PROPERTY


def test_tensor_take_spans_pieces() -> None:
    stream = torch.arange(20).reshape(10, 2)
    buffer = TensorBuffer("t", stream)
    for lo, hi in [(0, 3), (3, 4), (4, 9), (9, 10)]:
        buffer.append(stream[lo:hi])
    buffer.release_before(2)
    assert (buffer.start, buffer.end, len(buffer)) == (2, 10, 8)
    for lo, hi in [(2, 10), (2, 3), (3, 4), (5, 9), (8, 10)]:
        assert torch.equal(buffer.take(lo, hi), stream[lo:hi])


def test_an_empty_take_is_of_the_stream_kind() -> None:
    buffer = TensorBuffer("t", torch.zeros(1, 2, dtype=torch.int16))
    buffer.append(torch.ones(3, 2, dtype=torch.int16))
    empty = buffer.take(3, 3)
    assert (empty.shape, empty.dtype) == ((0, 2), torch.int16)
    lists = ListBuffer("l")
    lists.append([1, 2])
    assert lists.take(2, 2) == []


def test_a_large_pushed_tensor_is_not_pinned_by_its_tail() -> None:
    big = torch.zeros(100_000, 4)
    buffer = TensorBuffer("t", big)
    buffer.append(big)
    buffer.release_before(100_000 - 3)
    assert len(buffer) == 3
    [piece] = buffer._pieces
    assert piece.untyped_storage().nbytes() == 3 * 4 * big.element_size()


def test_list_storage_stays_proportional_to_what_is_retained() -> None:
    buffer = ListBuffer("l")
    for i in range(10_000):
        buffer.append([i])
        buffer.release_before(i + 1 - 28)
        assert len(buffer._items) <= 2 * 28 + 1
    assert buffer.take(10_000 - 28, 10_000) == list(range(10_000 - 28, 10_000))


def test_new_buffer_picks_the_kind() -> None:
    assert isinstance(new_buffer("o", [1]), ListBuffer)
    assert isinstance(new_buffer("o", torch.zeros(1)), TensorBuffer)
    with pytest.raises(PolicyError, match="^o: push takes"):
        new_buffer("o", torch.tensor(0))


@pytest.mark.parametrize("kind", ["list", "tensor"])
@PROPERTY
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 40))))
def test_buffer_matches_a_plain_list(kind: str, ops: list[tuple[int, int, int]]) -> None:
    stream = list(range(sum(b for _, b, _ in ops)))
    whole = torch.tensor(stream).reshape(-1, 1)
    buffer: ItemBuffer = ListBuffer("l") if kind == "list" else TensorBuffer("t", whole)
    for op, a, b in ops:
        end = buffer.end
        if op == 0:
            buffer.append(stream[end : end + a] if kind == "list" else whole[end : end + a])
        elif op == 1:
            buffer.release_before(buffer.start + a)
        elif len(buffer):
            lo = buffer.start + a % len(buffer)
            hi = lo + 1 + b % (buffer.end - lo)
            got = buffer.take(lo, hi)
            as_list = got if isinstance(got, list) else got.flatten().tolist()
            assert as_list == stream[lo:hi]
        assert 0 <= buffer.start <= buffer.end
