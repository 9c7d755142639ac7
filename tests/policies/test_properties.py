"""Property tests: the shared chunk invariant and readiness, for every policy and both kinds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.policies import ChunkPolicy

from .support import (
    KINDS,
    POLICY_FAMILIES,
    PROPERTY,
    Items,
    Kind,
    concat,
    expected_count,
    retention_bound,
    run,
    same_items,
    split_streams,
)

FAMILIES = sorted(POLICY_FAMILIES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_chunks_are_stream_slices_covering_the_stream_once(
    family: str, kind: Kind, data: st.DataObject
) -> None:
    policy: ChunkPolicy = data.draw(POLICY_FAMILIES[family], label="policy")
    stream, pushes = data.draw(split_streams(kind), label="stream, pushes")
    result = run(policy, pushes)
    chunks = result.chunks

    delivered = 0
    for chunk in chunks:
        assert same_items(chunk.data, stream[chunk.start : chunk.end])
        if isinstance(chunk.data, torch.Tensor):
            assert chunk.data.is_contiguous()
        # The new part starts exactly where the previous chunks left off, and is never empty.
        assert chunk.start + chunk.context == delivered
        assert len(chunk.new) >= 1
        delivered = chunk.end
    assert delivered == len(stream)
    assert same_items(concat([c.new for c in chunks], stream), stream)

    starts = [c.start for c in chunks]
    assert starts == sorted(starts)
    assert all(not c.final for c in result.pushed_chunks)
    assert len(result.closing) <= 1
    assert [c.final for c in result.closing] == [True] * len(result.closing)
    assert policy.closed and policy.buffered == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_a_chunk_is_emitted_as_soon_as_it_is_complete(
    family: str, kind: Kind, data: st.DataObject
) -> None:
    policy: ChunkPolicy = data.draw(POLICY_FAMILIES[family], label="policy")
    _, pushes = data.draw(split_streams(kind), label="stream, pushes")
    count = expected_count(policy)
    result = run(policy, pushes)
    emitted = 0
    for n, chunks in zip(result.counts, result.per_push, strict=True):
        emitted += len(chunks)
        assert emitted == count(n), f"after {n} items"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_retains_only_what_it_may_still_need(family: str, kind: Kind, data: st.DataObject) -> None:
    policy: ChunkPolicy = data.draw(POLICY_FAMILIES[family], label="policy")
    _, pushes = data.draw(split_streams(kind), label="stream, pushes")
    result = run(policy, pushes)
    bound = retention_bound(policy)
    for n, held in zip(result.counts, result.buffered, strict=True):
        assert held <= min(n, bound), f"after {n} items"


@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_list_and_tensor_streams_are_cut_alike(family: str, data: st.DataObject) -> None:
    policy: ChunkPolicy = data.draw(POLICY_FAMILIES[family], label="policy")
    _, pushes = data.draw(split_streams("tensor"), label="stream, pushes")
    as_lists: list[Items] = [p if isinstance(p, list) else p.tolist() for p in pushes]
    by_tensor = run(policy.fresh(), pushes).chunks
    by_list = run(policy.fresh(), as_lists).chunks
    assert [(c.start, c.end, c.context, c.final) for c in by_tensor] == [
        (c.start, c.end, c.context, c.final) for c in by_list
    ]
    for t, lst in zip(by_tensor, by_list, strict=True):
        assert isinstance(t.data, torch.Tensor)
        assert t.data.tolist() == lst.data
