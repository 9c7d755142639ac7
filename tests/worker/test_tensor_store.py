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


def test_large_top_level_tensors_become_handles_small_ones_and_the_rest_travel() -> None:
    store = TensorStore(rank=2, generation=3, keep_bytes=64)
    big = torch.arange(16, dtype=torch.float32)  # 64 bytes: kept
    small = torch.arange(15, dtype=torch.float32)
    store.step_started("r")
    out = store.keep("r", {"big": big, "small": small, "nested": [big], "n": 1})
    ref = out["big"]
    assert ref == TensorRef(2, "3.0", (16,), "float32")
    assert out["small"] is small and out["nested"][0] is big and out["n"] == 1
    assert store.get(ref) is big  # the object itself: nothing copied on this worker
    assert store.stats() == {
        "tensors_held": 1,
        "tensor_bytes_held": 64,
        "requests_held": 1,
        "steps_running": 0,
    }


def test_release_frees_and_a_stale_or_foreign_handle_is_refused() -> None:
    store = TensorStore(rank=0, generation=1, keep_bytes=1)
    store.step_started("r")
    ref = store.keep("r", {"x": torch.ones(2)})["x"]
    with pytest.raises(TensorNotHeld, match="rank 0 holds no tensor"):
        store.get(TensorRef(1, ref.key, ref.shape, ref.dtype))  # another rank's handle
    store.release("r")
    store.release("r")  # idempotent
    assert len(store) == 0
    with pytest.raises(TensorNotHeld, match="released or the worker restarted"):
        store.get(ref)
    restarted = TensorStore(rank=0, generation=2, keep_bytes=1)
    restarted.step_started("r")
    restarted.keep("r", {"x": torch.ones(2)})
    with pytest.raises(TensorNotHeld):
        restarted.get(ref)  # same rank and counter, older generation


def test_a_step_finishing_after_its_release_keeps_nothing() -> None:
    store = TensorStore(rank=0, generation=1, keep_bytes=1)
    store.step_started("r")
    store.step_started("r")
    store.release("r")
    assert isinstance(store.keep("r", {"x": torch.ones(2)})["x"], torch.Tensor)
    store.step_failed("r")
    assert store.stats()["steps_running"] == 0 and len(store) == 0
    store.step_started("r")  # the id comes back (a new request under the same id): kept again
    assert isinstance(store.keep("r", {"x": torch.ones(2)})["x"], TensorRef)


@settings(max_examples=60, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["start", "keep", "fail", "release"]), st.integers(0, 2)),
        max_size=40,
    )
)
def test_nothing_outlives_its_request(ops: list[tuple[str, int]]) -> None:
    store = TensorStore(rank=0, generation=1, keep_bytes=1)
    running = {r: 0 for r in range(3)}
    for op, r in ops:
        rid = f"r{r}"
        if op == "start":
            store.step_started(rid)
            running[r] += 1
        elif op in ("keep", "fail") and running[r]:
            running[r] -= 1
            if op == "keep":
                store.keep(rid, {"x": torch.ones(1)})
            else:
                store.step_failed(rid)
        elif op == "release":
            store.release(rid)
    for r, count in running.items():
        store.release(f"r{r}")  # the request ends with steps still running...
        for _ in range(count):  # ...which finish afterwards
            store.keep(f"r{r}", {"x": torch.ones(1)})
    assert store.stats() == {
        "tensors_held": 0,
        "tensor_bytes_held": 0,
        "requests_held": 0,
        "steps_running": 0,
    }
