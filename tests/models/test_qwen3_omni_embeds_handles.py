"""``EmbedsKVEngine`` handles (the talker's kept conversation): a retained request keeps its
keyed leading rows, a ``resume``d step computes only the rows past what its keys share and ends
with the hidden state a whole prefill gives, ``rewind`` frees a handle's blocks past a departure
at once, an evictable handle gives way to a request that needs its room, and ``keep`` keeps a
shared prefix only when its handle lacks the rows."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import pytest
import torch

from mstar_async.engines import Step
from mstar_async.engines.kv.sequences import HandleKey
from mstar_async.errors import KVCacheFull
from mstar_async.models.qwen3_omni.config import SIZES
from mstar_async.models.qwen3_omni.decoder import Qwen3Stack, seeded_init
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine, EmbedsOp, Sampler

pytestmark = pytest.mark.timeout(60)

CFG = SIZES["tiny"].talker
ROWS = torch.randn(20, CFG.hidden_size, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _finish(
    hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
) -> list[dict[str, Any]]:
    return [{"hidden": h.clone()} for h in hidden]


class World:
    """The tiny talker's stack on an engine whose one op feeds the rows it is given, keyed by
    ``keys`` (the leading rows a conversation may keep), counting the rows it computes."""

    def __init__(self, num_blocks: int = 64) -> None:
        stack = Qwen3Stack(CFG)
        seeded_init(stack, 5)
        self.computed = 0

        def counting(x: torch.Tensor, attention: Any) -> torch.Tensor:
            self.computed += int(x.shape[0])
            out: torch.Tensor = stack(x, attention)
            return out

        op = EmbedsOp(
            lambda inputs: inputs["rows"],
            _finish,
            cost=lambda inputs: int(inputs["rows"].shape[0]),
            keys=lambda inputs: list(inputs["keys"]),
        )
        self.engine = EmbedsKVEngine(
            counting,
            CFG.attention_spec(torch.float32),
            {"prefill": op},
            num_layers=CFG.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=4,
        )

    def run(self, request: str, op: str, **inputs: Any) -> Any:
        step = Step(request, op, inputs, budget=5)  # rows split over forwards
        for _ in range(50):
            (out,) = self.engine.forward([step])
            if isinstance(out, Exception):
                raise out
            if isinstance(out, dict):
                return out
        raise AssertionError(f"{op} of {request} never finished")

    def prefill(self, request: str, rows: torch.Tensor, keys: list[Hashable], **inputs: Any) -> Any:
        return self.run(request, "prefill", rows=rows, keys=keys, **inputs)["hidden"]


def _keys(n: int, changed_from: int | None = None) -> list[Hashable]:
    return [
        ("row", i) if changed_from is None or i < changed_from else ("other", i) for i in range(n)
    ]


def test_a_resumed_step_computes_only_the_rows_its_keys_do_not_share() -> None:
    world = World()
    world.run("t1", "retain", handle="conv")
    world.prefill("t1", ROWS[:14], _keys(10))  # 10 keyed rows lead 14
    world.engine.release("t1")
    assert world.engine.handles == {"conv": ("session", 10, 3)}
    for departs, reused in ((None, 10), (6, 6)):
        world.computed, before = 0, world.engine.reused_tokens
        keys = _keys(12, departs)
        hidden = world.prefill("t2", ROWS[:16], keys, resume="conv")
        assert world.computed == 16 - reused == 16 - (world.engine.reused_tokens - before)
        world.engine.release("t2")
        fresh = World()
        assert torch.allclose(hidden, fresh.prefill("f", ROWS[:16], keys), atol=1e-5)
    assert world.engine.handles == {"conv": ("session", 10, 3)}  # a resume leaves it whole


def test_rewind_frees_the_handle_past_the_departure_at_once() -> None:
    world = World()
    world.run("t1", "retain", handle="conv")
    world.prefill("t1", ROWS[:14], _keys(13))
    world.engine.release("t1")
    assert world.engine.blocks_in_use == 4
    assert world.run("r", "rewind", handle="conv", keys=_keys(13, 5)) == {"tokens": 5}
    world.engine.release("r")
    assert world.engine.handles == {"conv": ("session", 5, 2)} and world.engine.blocks_in_use == 2
    assert world.run("r", "rewind", handle="gone", keys=_keys(3)) == {"tokens": 0}
    assert world.run("d", "drop", handle="conv") == {"dropped": True}
    assert world.engine.blocks_in_use == 0
    world.engine.allocator.check_invariants()


@pytest.mark.parametrize("evictable", [True, False])
def test_an_evictable_handle_gives_way_and_a_session_does_not(evictable: bool) -> None:
    world = World(num_blocks=6)  # 24 rows
    world.run("t1", "retain", handle="conv", evictable=evictable)
    world.prefill("t1", ROWS[:12], _keys(12))
    world.engine.release("t1")
    if evictable:
        world.prefill("big", ROWS[:20], _keys(20))  # needs the handle's 3 blocks
        assert world.engine.handles == {}
    else:
        with pytest.raises(KVCacheFull):
            world.prefill("big", ROWS[:20], _keys(20))
        assert world.engine.handles == {"conv": ("session", 12, 3)}
    world.engine.release("big")
    world.engine.drop_handle("conv")
    assert world.engine.blocks_in_use == 0


def test_keep_keeps_a_shared_prefix_once_and_again_only_when_it_lacks_the_rows() -> None:
    world = World()
    table = world.engine.allocator.block_table
    world.prefill("a", ROWS[:14], _keys(10), keep="p", resume="p")  # first use: all computed
    world.engine.release("a")
    assert world.engine.handles == {"p": ("prefix", 10, 3)}
    kept = list(table(HandleKey("p")))
    world.computed = 0
    world.prefill("b", ROWS[:14], _keys(10), keep="p", resume="p")
    world.engine.release("b")
    assert world.computed == 4 and world.engine.reused_tokens == 10
    # Not kept again: the handle's blocks are the first request's (b's copy of the last,
    # partly filled block went with b).
    assert list(table(HandleKey("p"))) == kept
    world.prefill("c", ROWS[:14], _keys(10, 6), keep="p", resume="p")  # departs at row 6
    world.engine.release("c")
    assert world.engine.reused_tokens == 16 and world.engine.handles == {"p": ("prefix", 10, 3)}
    world.computed = 0
    world.prefill("d", ROWS[:14], _keys(10), keep="p", resume="p")  # c's rows now: 6 shared
    assert world.computed == 8
    # Dropped while d is in flight: d keeps nothing when released.
    assert world.run("x", "drop", handle="p") == {"dropped": True}
    world.engine.release("d")
    world.engine.release("x")
    assert world.engine.handles == {} and world.engine.blocks_in_use == 0
    world.engine.allocator.check_invariants()
