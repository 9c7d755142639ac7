"""SlidingWindowChunkPolicy with exact values."""

from __future__ import annotations

import torch

from mstar_async.policies import Chunk, SlidingWindowChunkPolicy


def test_orpheus_window_over_40_items() -> None:
    policy = SlidingWindowChunkPolicy(window=28, stride=7)
    chunks = policy.push(list(range(40)))
    # Windows end at 28 and 35; the one ending at 42 never completes.
    assert chunks == [
        Chunk(list(range(0, 28)), start=0, context=0),
        Chunk(list(range(7, 35)), start=7, context=21),
    ]
    # The tail is the last 28 items, 12..39; 12..34 (23 items) went out already.
    assert policy.close() == [Chunk(list(range(12, 40)), start=12, context=23, final=True)]


def test_orpheus_window_one_item_at_a_time() -> None:
    policy = SlidingWindowChunkPolicy(28, 7)
    emitted_at = [i for i in range(60) if policy.push([i])]
    assert emitted_at == [27, 34, 41, 48, 55]  # 0-based index of the item that completes each
    [tail] = policy.close()
    # Windows delivered up to 28 + 4*7 = 56; the tail 32..59 has 56 - 32 = 24 old items.
    assert (tail.start, tail.end, tail.context, tail.final) == (32, 60, 24, True)
    assert tail.data == list(range(32, 60))


def test_close_after_a_complete_window_returns_a_final_chunk_with_no_items() -> None:
    policy = SlidingWindowChunkPolicy(28, 7)
    assert len(policy.push(list(range(35)))) == 2
    assert policy.close() == [Chunk([], start=35, final=True)]


def test_short_stream_is_one_final_chunk() -> None:
    policy = SlidingWindowChunkPolicy(28, 7)
    assert policy.push(list(range(10))) == []
    assert policy.close() == [Chunk(list(range(10)), start=0, context=0, final=True)]


def test_stride_equal_to_window_has_no_overlap_until_the_tail() -> None:
    policy = SlidingWindowChunkPolicy(4, 4)
    assert policy.push(list(range(10))) == [
        Chunk([0, 1, 2, 3], start=0, context=0),
        Chunk([4, 5, 6, 7], start=4, context=0),
    ]
    # The tail is still a full window, 6..9, of which 6 and 7 were delivered.
    assert policy.close() == [Chunk([6, 7, 8, 9], start=6, context=2, final=True)]


def test_stride_one() -> None:
    policy = SlidingWindowChunkPolicy(3, 1)
    assert policy.push(list("abcde")) == [
        Chunk(["a", "b", "c"], start=0, context=0),
        Chunk(["b", "c", "d"], start=1, context=2),
        Chunk(["c", "d", "e"], start=2, context=2),
    ]
    assert policy.close() == [Chunk([], start=5, final=True)]


def test_tensor_items() -> None:
    stream = torch.arange(20).reshape(10, 2)
    policy = SlidingWindowChunkPolicy(4, 3)
    first = policy.push(stream[:5])
    second = policy.push(stream[5:])
    assert first == [Chunk(stream[0:4], start=0)]
    assert second == [
        Chunk(stream[3:7], start=3, context=1),
        Chunk(stream[6:10], start=6, context=1),
    ]
    assert policy.close() == [Chunk(stream[:0], start=10, final=True)]
    new = second[0].new
    assert isinstance(new, torch.Tensor)
    assert new.tolist() == [[8, 9], [10, 11], [12, 13]]


def test_memory_stays_within_one_window() -> None:
    policy = SlidingWindowChunkPolicy(28, 7)
    tensor_policy = policy.fresh()
    item = torch.zeros(1, 4)
    most = 0
    for i in range(10_000):
        policy.push([i])
        tensor_policy.push(item)
        most = max(most, policy.buffered, tensor_policy.buffered)
    assert policy.buffered <= 28 and tensor_policy.buffered <= 28
    assert most <= 28
    [tail] = policy.close()
    assert tail.data == list(range(10_000 - 28, 10_000))
