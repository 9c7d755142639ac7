"""The tensor store's bookkeeping: what it keeps, what a handle resolves to, what release frees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.errors import TensorNotHeld
from mstar_async.transport import TensorRef
from mstar_async.worker.tensor_store import TensorStore

pytestmark = pytest.mark.timeout(30)


def test_large_tensors_become_handles_small_ones_and_the_rest_travel() -> None:
    store = TensorStore(rank=2, generation=3, keep_bytes=64)
    big = torch.arange(16, dtype=torch.float32)  # 64 bytes: kept
    small = torch.arange(15, dtype=torch.float32)
    ref = store.hold("r", big)
    assert ref == TensorRef(2, "3.0", (16,), "float32")
    assert store.hold("r", small) is small and store.hold("r", [big])[0] is big
    assert store.hold("r", 1) == 1
    assert store.get(ref) is big  # the object itself: nothing copied on this worker
    assert store.stats() == {"tensors_held": 1, "tensor_bytes_held": 64, "requests_held": 1}


def test_release_frees_and_a_stale_or_foreign_handle_is_refused() -> None:
    store = TensorStore(rank=0, generation=1, keep_bytes=1)
    ref = store.hold("r", torch.ones(2))
    with pytest.raises(TensorNotHeld, match="rank 0 holds no tensor"):
        store.get(TensorRef(1, ref.key, ref.shape, ref.dtype))  # another rank's handle
    store.release("r")
    store.release("r")  # idempotent
    assert len(store) == 0
    with pytest.raises(TensorNotHeld, match="released or the worker restarted"):
        store.get(ref)
    restarted = TensorStore(rank=0, generation=2, keep_bytes=1)
    restarted.hold("r", torch.ones(2))
    with pytest.raises(TensorNotHeld):
        restarted.get(ref)  # same rank and counter, older generation


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "release"]), st.integers(0, 2)), max_size=40))
def test_nothing_outlives_its_request(ops: list[tuple[str, int]]) -> None:
    store = TensorStore(rank=0, generation=1, keep_bytes=1)
    for op, r in ops:
        if op == "hold":
            store.hold(f"r{r}", torch.ones(1))
        else:
            store.release(f"r{r}")
    for r in range(3):
        store.release(f"r{r}")
    assert store.stats() == {"tensors_held": 0, "tensor_bytes_held": 0, "requests_held": 0}
