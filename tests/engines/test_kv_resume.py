"""``prefill`` with ``resume``: a new turn reuses the longest prefix its prompt shares with a
kept conversation (rows compared by content), computes only the rest, and samples what a full
prefill of the same prompt samples; a prompt that departs earlier (an edited or truncated turn)
rolls the kept sequence back to that point without touching the handle."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_async.engines import Step
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.models.qwen3_omni.config import SIZES
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.thinker import Thinker

pytestmark = pytest.mark.timeout(60)

VOCAB = 96
TURN1 = [(7 * i + 3) % VOCAB for i in range(13)]
TURN2 = [(11 * i + 5) % VOCAB for i in range(6)]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


class Counted:
    """The tiny thinker on a paged engine, counting the tokens its forwards compute."""

    def __init__(self, num_blocks: int = 64, capture_layer: int | None = None) -> None:
        thinker = Thinker(SIZES["tiny"].thinker, VOCAB, capture_layer)
        seeded_init(thinker, 3)
        cfg = thinker.config
        self.engine = KVCacheEngine(
            thinker.eval(),
            cfg.attention_spec(torch.float32),
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=4,
        )
        self.computed = 0
        forward = self.engine._forward

        def counting(input_ids: torch.Tensor, attention: Any, **extra: Any) -> torch.Tensor:
            self.computed += int(input_ids.shape[0])
            out: torch.Tensor = forward(input_ids, attention, **extra)
            return out

        self.engine._forward = counting

    def run(self, request: str, op: str, **inputs: Any) -> Any:
        step = Step(request, op, inputs, budget=5)  # prompts split over forwards
        for _ in range(50):
            (out,) = self.engine.forward([step])
            if out is not None:
                assert isinstance(out, dict), out
                return out
        raise AssertionError(f"{op} of {request} never finished")

    def turn(self, request: str, prompt: list[int], n: int = 3, **inputs: Any) -> list[int]:
        """Prefill ``prompt`` (with ``inputs``), then decode: the ``n`` greedy tokens."""
        out = [int(self.run(request, "prefill", tokens=torch.tensor(prompt), **inputs)["token"])]
        while len(out) < n:
            out.append(int(self.run(request, "decode", token=out[-1])["token"]))
        return out


def _fresh(prompt: list[int], **inputs: Any) -> int:
    return Counted().turn("fresh", prompt, n=1, **inputs)[0]


def test_a_new_turn_computes_only_its_new_tokens_and_samples_as_a_full_prefill() -> None:
    world = Counted()
    world.run("t1", "retain", handle="conv")
    reply = world.turn("t1", TURN1)
    world.engine.release("t1")
    # The kept sequence: the prompt and every reply token fed back (the last one never was).
    assert world.engine.handles["conv"][:2] == ("session", len(TURN1) + 2)
    prompt = TURN1 + reply + TURN2
    world.computed = 0
    first = world.turn("t2", prompt, n=1, resume="conv")[0]
    assert world.computed == len(prompt) - (len(TURN1) + 2)
    assert world.engine.reused_tokens == len(TURN1) + 2
    assert first == _fresh(prompt)
    world.engine.release("t2")
    world.engine.drop_handle("conv")
    assert world.engine.blocks_in_use == 0
    world.engine.allocator.check_invariants()


@pytest.mark.parametrize(("conv", "warm"), [(15, 0), (15, 9), (9, 15), (0, 15), (0, 0), (5, 5)])
def test_of_several_handles_the_one_sharing_the_most_is_resumed(conv: int, warm: int) -> None:
    # A conversation kept by its last turn, and the next turn's opening computed ahead of it
    # (while the user spoke): each shares some leading tokens of the prompt, then departs.
    prompt = TURN1 + TURN2
    world = Counted()
    for name, shared in (("conv", conv), ("warm", warm)):
        world.run(name, "retain", handle=name)
        kept = prompt[:shared] + [(t + 1) % VOCAB for t in prompt[shared : shared + 3]]
        world.turn(name, kept, n=1)
        world.engine.release(name)
    world.computed = 0
    first = world.turn("t", prompt, n=1, resume=("conv", "warm", "gone"))[0]
    assert world.computed == len(prompt) - max(conv, warm)
    assert world.engine.reused_tokens == max(conv, warm)
    assert first == _fresh(prompt)
    world.engine.release("t")
    for name in ("conv", "warm"):
        world.engine.drop_handle(name)
    assert world.engine.blocks_in_use == 0
    world.engine.allocator.check_invariants()


@pytest.mark.parametrize("departs", [0, 3, 8, 14])
def test_a_prompt_that_departs_earlier_rolls_back_to_there(departs: int) -> None:
    world = Counted()
    world.run("t1", "retain", handle="conv")
    reply = world.turn("t1", TURN1)
    world.engine.release("t1")
    kept = TURN1 + reply[:2]
    edited = kept[:departs] + [(t + 1) % VOCAB for t in kept[departs:]] + TURN2
    world.computed = 0
    first = world.turn("t2", edited, n=1, resume="conv")[0]
    assert world.computed == len(edited) - departs
    assert first == _fresh(edited)
    world.engine.release("t2")
    # The handle is as it was: a turn continuing it still reuses all of it.
    world.computed = 0
    world.turn("t3", kept + TURN2, n=1, resume="conv")
    assert world.computed == len(TURN2)
    world.engine.release("t3")
    world.engine.drop_handle("conv")
    assert world.engine.blocks_in_use == 0


def test_rows_are_compared_by_content() -> None:
    width = SIZES["tiny"].thinker.hidden_size
    gen = torch.Generator().manual_seed(0)
    rows, other = torch.randn(4, width, generator=gen), torch.randn(4, width, generator=gen)
    at = torch.tensor([3, 4, 5, 6])
    world = Counted()
    world.run("t1", "retain", handle="conv")
    world.turn("t1", TURN1, n=1, embeds=rows, embeds_at=at)
    world.engine.release("t1")
    for given, reused in ((rows, len(TURN1)), (other, 3)):
        world.computed = 0
        prompt = TURN1 + TURN2
        first = world.turn("t2", prompt, n=1, embeds=given, embeds_at=at, resume="conv")[0]
        assert world.computed == len(prompt) - reused
        assert first == _fresh(prompt, embeds=given, embeds_at=at)
        world.engine.release("t2")


def test_an_evictable_conversation_gives_way_and_is_recomputed() -> None:
    world = Counted(num_blocks=8)  # 32 slots
    world.run("t1", "retain", handle="conv", evictable=True)
    world.turn("t1", TURN1, n=1)
    world.engine.release("t1")
    assert world.engine.handles["conv"][0] == "prefix"
    world.turn("big", [1] * 30, n=1)  # needs the conversation's blocks: it is evicted
    assert "conv" not in world.engine.handles
    world.engine.release("big")
    world.computed = 0
    first = world.turn("t2", TURN1 + TURN2, n=1, resume="conv")[0]
    assert world.computed == len(TURN1 + TURN2)  # nothing to resume from: all computed
    assert first == _fresh(TURN1 + TURN2)
    world.engine.release("t2")
    assert world.engine.blocks_in_use == 0


@pytest.mark.parametrize("departs", [0, 3, 8, 14])
def test_rewind_frees_the_handle_past_where_a_prompt_departs_at_once(departs: int) -> None:
    world = Counted()
    world.run("t1", "retain", handle="conv")
    reply = world.turn("t1", TURN1)
    world.engine.release("t1")
    kept = TURN1 + reply[:2]  # 15 tokens in blocks of 4: 4 blocks
    assert world.engine.blocks_in_use == 4
    edited = kept[:departs] + [(t + 1) % VOCAB for t in kept[departs:]]
    out = world.run("r", "rewind", handle="conv", tokens=torch.tensor(edited))
    world.engine.release("r")
    assert out == {"tokens": departs, "embeds_out": None}
    assert world.engine.handles["conv"] == ("session", departs, -(-departs // 4))
    assert world.engine.blocks_in_use == -(-departs // 4)  # the rest came back at once
    world.engine.allocator.check_invariants()
    # The next turn starts from the rewound conversation and answers as a fresh prefill.
    world.computed = 0
    prompt = edited + TURN2
    first = world.turn("t2", prompt, n=1, resume="conv")[0]
    assert world.computed == len(prompt) - departs
    assert first == _fresh(prompt)
    world.engine.release("t2")
    world.engine.drop_handle("conv")
    assert world.engine.blocks_in_use == 0
    # An unknown handle keeps nothing and fails nothing.
    assert world.run("r2", "rewind", handle="gone", tokens=[1, 2]) == {
        "tokens": 0,
        "embeds_out": None,
    }


def test_rewind_keeps_each_row_that_is_unchanged_and_reports_its_output() -> None:
    width = SIZES["tiny"].thinker.hidden_size
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, width, generator=gen)
    at = torch.tensor([2, 3, 4, 8, 9, 10])  # two spoken turns of three rows
    world = Counted(capture_layer=1)
    world.run("t1", "retain", handle="conv")
    made = world.run("t1", "prefill", tokens=torch.tensor(TURN1), embeds=rows, embeds_at=at)
    world.engine.release("t1")
    # The second turn's audio is other audio: the rows of the first turn stay, each one
    # digested alone, and the thinker's rows at them come back for the talker.
    changed = torch.cat([rows[:3], rows[3:].flip(0)])
    out = world.run("r", "rewind", handle="conv", tokens=TURN1, embeds=changed, embeds_at=at)
    assert out["tokens"] == 8
    assert torch.equal(out["embeds_out"], made["embeds_out"][:3])
    world.engine.release("r")
    world.computed = 0
    first = world.turn("t2", TURN1, n=1, embeds=changed, embeds_at=at, resume="conv")[0]
    assert world.computed == len(TURN1) - 8
    assert first == _fresh(TURN1, embeds=changed, embeds_at=at)
