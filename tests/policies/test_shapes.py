"""Property tests: each policy's own chunk shape, for list and tensor streams."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.policies import (
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

from .support import (
    KINDS,
    PROPERTY,
    Kind,
    fixed_policies,
    left_context_policies,
    run,
    sliding_policies,
    split_streams,
)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_fixed_chunks_are_back_to_back_and_full(kind: Kind, data: st.DataObject) -> None:
    policy: FixedChunkPolicy = data.draw(fixed_policies, label="policy")
    stream, pushes = data.draw(split_streams(kind), label="stream, pushes")
    size, n = policy.size, len(stream)
    result = run(policy, pushes)
    for i, chunk in enumerate(result.pushed_chunks):
        assert (chunk.start, len(chunk), chunk.context) == (i * size, size, 0)
    if n % size:
        [tail] = result.closing
        assert (tail.start, len(tail), tail.context) == (n - n % size, n % size, 0)
        assert len(tail) < size and tail.final
    else:
        [end] = result.closing
        assert (end.start, len(end), end.final) == (n, 0, True)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_sliding_windows_step_by_stride(kind: Kind, data: st.DataObject) -> None:
    policy: SlidingWindowChunkPolicy = data.draw(sliding_policies, label="policy")
    stream, pushes = data.draw(split_streams(kind), label="stream, pushes")
    window, stride, n = policy.window, policy.stride, len(stream)
    result = run(policy, pushes)
    pushed = result.pushed_chunks
    for j, chunk in enumerate(pushed):
        overlap = 0 if j == 0 else window - stride
        assert (chunk.start, len(chunk), chunk.context) == (j * stride, window, overlap)
    delivered = pushed[-1].end if pushed else 0
    if delivered < n:
        [tail] = result.closing
        assert len(tail) == min(window, n)
        assert tail.end == n
        assert tail.context == delivered - tail.start
    else:
        [end] = result.closing
        assert (end.start, len(end), end.final) == (n, 0, True)


@pytest.mark.parametrize("kind", KINDS)
@PROPERTY
@given(data=st.data())
def test_left_context_chunks_lead_with_old_items_and_trail_look_ahead(
    kind: Kind, data: st.DataObject
) -> None:
    policy: LeftContextChunkPolicy = data.draw(left_context_policies, label="policy")
    stream, pushes = data.draw(split_streams(kind), label="stream, pushes")
    size, left, ahead, n = policy.chunk, policy.left_context, policy.lookahead, len(stream)
    result = run(policy, pushes)
    pushed = result.pushed_chunks
    for i, chunk in enumerate(pushed):
        assert chunk.context == min(left, i * size)
        assert chunk.start + chunk.context == i * size
        assert len(chunk.new) == size
        assert (chunk.lookahead, chunk.end) == (ahead, (i + 1) * size + ahead)
    # close() goes on along the same grid: new items [j*size, (j+1)*size) cut at n.
    delivered = len(pushed) * size
    if delivered < n:
        grid = list(range(delivered, n, size))
        assert len(result.closing) == len(grid)
        for new, chunk in zip(grid, result.closing, strict=True):
            stop = min(new + size, n)
            assert chunk.start + chunk.context == new
            assert chunk.context == min(left, new)
            assert (chunk.end - chunk.lookahead, chunk.lookahead) == (stop, min(ahead, n - stop))
    else:
        [end] = result.closing
        assert (end.start, len(end), end.final) == (n, 0, True)
