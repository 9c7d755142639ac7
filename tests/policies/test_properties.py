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

#: 200 examples a property, for every policy: the long property tests run in the slow set; each
#: policy's own tests (test_fixed, test_sliding_window, ...) stay in the default one.
pytestmark = pytest.mark.slow

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
        # Only a stream that carried nothing ends in data of no kind: an empty list.
        pushed_nothing = not len(stream) and chunk.data == []
        assert pushed_nothing or same_items(chunk.data, stream[chunk.start : chunk.end])
        if isinstance(chunk.data, torch.Tensor):
            assert chunk.data.is_contiguous()
        # The new part starts exactly where the previous chunks left off, and only the final
        # chunk may have none; look-ahead is never delivered before its own chunk.
        assert chunk.start + chunk.context == delivered
        assert len(chunk.new) >= 1 or chunk.final
        delivered = chunk.end - chunk.lookahead
    assert delivered == len(stream)
    assert same_items(concat([c.new for c in chunks if len(c.new)], stream), stream)

    starts = [c.start for c in chunks]
    assert starts == sorted(starts)
    # Exactly one final chunk, the last, even for a stream that ends on a chunk boundary or
    # carries nothing; nothing follows it, so it looks ahead at nothing.
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert result.closing and result.closing[-1] is chunks[-1]
    final = chunks[-1]
    assert final.lookahead == 0 and final.end == len(stream)
    if not len(final.new):
        assert len(final.data) == 0 and final.start == len(stream)
    assert policy.closed and policy.buffered == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_look_ahead_is_full_until_the_stream_ends(
    family: str, kind: Kind, data: st.DataObject
) -> None:
    policy: ChunkPolicy = data.draw(POLICY_FAMILIES[family], label="policy")
    stream, pushes = data.draw(split_streams(kind), label="stream, pushes")
    ahead = policy.params.get("lookahead", 0)
    result = run(policy, pushes)
    assert all(c.lookahead == ahead for c in result.pushed_chunks)
    # On close, each chunk sees whatever follows it, up to the policy's look-ahead.
    for chunk in result.closing:
        new_end = chunk.end - chunk.lookahead
        assert chunk.lookahead == min(ahead, len(stream) - new_end)


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
    assert [(c.start, c.end, c.context, c.lookahead, c.final) for c in by_tensor] == [
        (c.start, c.end, c.context, c.lookahead, c.final) for c in by_list
    ]
    for t, lst in zip(by_tensor, by_list, strict=True):
        if len(t.data) == 0:  # a final chunk with no items
            assert lst.data == []
        else:
            assert isinstance(t.data, torch.Tensor) and t.data.tolist() == lst.data
