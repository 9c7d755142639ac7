"""FixedChunkPolicy with exact values."""

from __future__ import annotations

import torch

from mstar_async.policies import Chunk, FixedChunkPolicy


def test_back_to_back_chunks_and_a_remainder() -> None:
    policy = FixedChunkPolicy(4)
    assert policy.push(list(range(10))) == [
        Chunk([0, 1, 2, 3], start=0),
        Chunk([4, 5, 6, 7], start=4),
    ]
    assert policy.buffered == 2
    assert policy.close() == [Chunk([8, 9], start=8, final=True)]
    assert policy.buffered == 0


def test_no_remainder_means_a_final_chunk_with_no_items() -> None:
    policy = FixedChunkPolicy(5)
    assert len(policy.push(list(range(10)))) == 2
    assert policy.close() == [Chunk([], start=10, final=True)]


def test_one_item_at_a_time() -> None:
    policy = FixedChunkPolicy(3)
    assert [i for i in range(9) if policy.push([i])] == [2, 5, 8]
    assert policy.close() == [Chunk([], start=9, final=True)]


def test_size_one_emits_every_item() -> None:
    policy = FixedChunkPolicy(1)
    assert policy.push(["a", "b"]) == [Chunk(["a"], start=0), Chunk(["b"], start=1)]


def test_empty_stream() -> None:
    policy = FixedChunkPolicy(3)
    assert policy.push([]) == []
    assert policy.push(torch.empty(0, 2)) == []
    # Nothing fixed the kind: the final chunk is an empty list, which every kind accepts.
    assert policy.close() == [Chunk([], start=0, final=True)]


def test_tensor_items() -> None:
    stream = torch.arange(14, dtype=torch.int64).reshape(7, 2)
    policy = FixedChunkPolicy(3)
    chunks = policy.push(stream[:1]) + policy.push(stream[1:5]) + policy.push(stream[5:])
    assert chunks == [Chunk(stream[0:3], start=0), Chunk(stream[3:6], start=3)]
    assert policy.close() == [Chunk(stream[6:7], start=6, final=True)]
    assert all(c.data.dtype == torch.int64 for c in chunks)  # type: ignore[union-attr]
