"""LeftContextChunkPolicy with exact values."""

from __future__ import annotations

import torch

from mstar_async.policies import Chunk, FixedChunkPolicy, LeftContextChunkPolicy


def test_qwen3_omni_code2wav_over_60_items() -> None:
    policy = LeftContextChunkPolicy(chunk=25, left_context=25)
    assert policy.push(list(range(60))) == [
        Chunk(list(range(0, 25)), start=0, context=0),
        Chunk(list(range(0, 50)), start=0, context=25),
    ]
    # New items 50..59, after the 25 before them.
    assert policy.close() == [Chunk(list(range(25, 60)), start=25, context=25, final=True)]


def test_one_item_at_a_time() -> None:
    policy = LeftContextChunkPolicy(25, 25)
    out = {i: policy.push([i]) for i in range(100)}
    assert [i for i, chunks in out.items() if chunks] == [24, 49, 74, 99]
    assert out[74] == [Chunk(list(range(25, 75)), start=25, context=25)]
    assert out[99] == [Chunk(list(range(50, 100)), start=50, context=25)]
    assert policy.close() == [Chunk([], start=100, final=True)]


def test_left_context_longer_than_chunk_grows_from_the_stream_start() -> None:
    policy = LeftContextChunkPolicy(2, 5)
    assert policy.push(list(range(7))) == [
        Chunk([0, 1], start=0, context=0),
        Chunk([0, 1, 2, 3], start=0, context=2),
        Chunk([0, 1, 2, 3, 4, 5], start=0, context=4),
    ]
    assert policy.close() == [Chunk([1, 2, 3, 4, 5, 6], start=1, context=5, final=True)]


def test_zero_left_context_cuts_like_fixed() -> None:
    stream = list(range(10))
    left, fixed = LeftContextChunkPolicy(4, 0), FixedChunkPolicy(4)
    assert left.push(stream) == fixed.push(stream)
    assert left.close() == fixed.close() == [Chunk([8, 9], start=8, final=True)]


def test_tensor_items() -> None:
    stream = torch.arange(8.0).reshape(8, 1)
    policy = LeftContextChunkPolicy(3, 2)
    assert policy.push(stream[:2]) == []
    assert policy.push(stream[2:7]) == [
        Chunk(stream[0:3], start=0),
        Chunk(stream[1:6], start=1, context=2),
    ]
    [tail] = policy.push(stream[7:]) + policy.close()
    assert tail == Chunk(stream[4:8], start=4, context=2, final=True)
    assert isinstance(tail.new, torch.Tensor)
    assert tail.new.flatten().tolist() == [6.0, 7.0]


def test_memory_stays_within_chunk_plus_left_context() -> None:
    policy = LeftContextChunkPolicy(25, 25)
    for i in range(5_000):
        policy.push([i])
        assert policy.buffered < 50


def test_orpheus_frames_one_before_two_after_over_45_items() -> None:
    # 7-item frames: each new frame between one frame of left context and two of look-ahead.
    policy = LeftContextChunkPolicy(chunk=7, left_context=7, lookahead=14)
    assert policy.push(list(range(45))) == [
        Chunk(list(range(0, 21)), start=0, context=0, lookahead=14),  # frame 0: none before
        Chunk(list(range(0, 28)), start=0, context=7, lookahead=14),
        Chunk(list(range(7, 35)), start=7, context=7, lookahead=14),
        Chunk(list(range(14, 42)), start=14, context=7, lookahead=14),
    ]
    # Frames 4 and 5 with what follows them (frame 5 and three items; three items), then the
    # three items of an unfinished frame, final.
    assert policy.close() == [
        Chunk(list(range(21, 45)), start=21, context=7, lookahead=10),
        Chunk(list(range(28, 45)), start=28, context=7, lookahead=3),
        Chunk(list(range(35, 45)), start=35, context=7, lookahead=0, final=True),
    ]


def test_a_chunk_waits_for_its_look_ahead() -> None:
    policy = LeftContextChunkPolicy(1, 0, 1)
    assert policy.push(["a"]) == []
    assert policy.push(["b"]) == [Chunk(["a", "b"], start=0, lookahead=1)]
    assert policy.push(["c"]) == [Chunk(["b", "c"], start=1, lookahead=1)]
    # The last item is new only in the final chunk, with nothing after it.
    assert policy.close() == [Chunk(["c"], start=2, final=True)]


def test_look_ahead_of_a_tensor_stream() -> None:
    stream = torch.arange(10.0).reshape(5, 2)
    policy = LeftContextChunkPolicy(2, 1, 2)
    [first] = policy.push(stream[:4])
    assert first == Chunk(stream[0:4], start=0, lookahead=2)
    assert isinstance(first.new, torch.Tensor) and first.new.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert policy.push(stream[4:]) == []  # items 2 and 3 wait for two more
    assert policy.close() == [
        Chunk(stream[1:5], start=1, context=1, lookahead=1),
        Chunk(stream[3:5], start=3, context=1, final=True),
    ]


def test_memory_stays_within_chunk_plus_both_contexts() -> None:
    policy = LeftContextChunkPolicy(7, 7, 14)
    for i in range(5_000):
        policy.push([i])
        assert policy.buffered < 7 + 7 + 14
