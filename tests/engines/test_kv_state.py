"""KV state that outlives a request in ``KVCacheEngine``: sessions (``retain`` / ``attach``)
and named prefixes (``prefix``), counted in the pool, dropped explicitly, prefixes evicted least
recently used when admission needs room; driven through the scheduler's rounds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_async.engines import Step
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.errors import EngineError
from mstar_async.models.bagel import bagel_config
from mstar_async.models.bagel.mot import BagelLM
from mstar_async.worker import Job, Scheduler


class Counted:
    """A KV engine on the tiny seeded BAGEL decoder whose model forwards are counted."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4) -> None:
        torch.manual_seed(0)
        lm = BagelLM(bagel_config("tiny"))
        self.engine = KVCacheEngine(
            lm,
            lm.language_model.attention_spec(),
            num_layers=2,
            num_blocks=num_blocks,
            block_size=block_size,
        )
        self.tokens = 0  # token ids the model's forward processed
        forward = self.engine._forward

        def counting(input_ids: torch.Tensor, attention: Any) -> torch.Tensor:
            self.tokens += int(input_ids.shape[0])
            out: torch.Tensor = forward(input_ids, attention)
            return out

        self.engine._forward = counting
        self.scheduler = Scheduler(
            {"lm": self.engine}, max_batch_tokens=8, max_batch_size=4, clock=lambda: 0.0
        )

    def run(self, request: str, op: str, **inputs: Any) -> Any:
        """Run one step to its outcome through the scheduler's rounds."""
        job = Job("lm", Step(request, op, inputs), owner=request)
        self.scheduler.submit(job)
        for _ in range(100):
            for done, outcome in self.scheduler.run_round():
                if done is job:
                    return outcome
        raise AssertionError(f"{op} of {request} never finished")

    def generate(self, request: str, tokens: list[int], n: int = 4) -> list[int]:
        """Prefill ``tokens`` then decode: the ``n`` greedy tokens sampled."""
        out = [int(self.run(request, "prefill", tokens=tokens)["token"])]
        while len(out) < n:
            out.append(int(self.run(request, "decode", token=out[-1])["token"]))
        return out


TURN1 = [(7 * i + 3) % 200 for i in range(10)]
TURN2 = [(11 * i + 5) % 200 for i in range(6)]


@pytest.mark.timeout(60)
def test_a_session_continues_from_its_retained_kv() -> None:
    world = Counted()
    engine = world.engine
    first = world.generate("t1", TURN1, n=2)  # KV: TURN1 + first[0]
    assert world.run("t1", "retain", handle="chat") == {}
    world.scheduler.release("t1")
    assert engine.handles == {"chat": ("session", 11, 3)}
    assert engine.blocks_in_use == 3  # counted in the pool while retained

    world.tokens = 0
    assert world.run("t2", "attach", handle="chat") == {"tokens": 11}
    second = world.generate("t2", TURN2, n=4)
    assert world.tokens == len(TURN2) + 3  # the new turn and three decodes, no recompute
    world.scheduler.release("t2")

    reference = world.generate("ref", [*TURN1, first[0], *TURN2], n=4)
    assert second == reference
    world.scheduler.release("ref")
    assert engine.blocks_in_use == 3  # the session is still held
    assert engine.drop_handle("chat") and not engine.drop_handle("chat")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(60)
def test_attach_to_an_unknown_handle_fails_alone_naming_it() -> None:
    world = Counted()
    failed = world.run("r", "attach", handle="nobody")
    assert isinstance(failed, EngineError) and "'nobody'" in str(failed)
    assert world.engine.blocks_in_use == 0


PROMPT = [(5 * i + 1) % 200 for i in range(12)]
QUESTION = [9, 8, 7]


@pytest.mark.timeout(60)
def test_a_second_request_hits_the_prefix_with_no_compute_and_the_same_output() -> None:
    world = Counted()
    engine = world.engine
    assert world.run("a", "prefix", handle="sys", tokens=PROMPT) == {"tokens": 12, "hit": False}
    assert world.tokens == 12  # computed once, in chunks of the scheduler's budget
    out_a = world.generate("a", QUESTION)
    world.scheduler.release("a")
    assert engine.handles == {"sys": ("prefix", 12, 3)}

    world.tokens = 0
    assert world.run("b", "prefix", handle="sys", tokens=PROMPT) == {"tokens": 12, "hit": True}
    assert world.tokens == 0
    assert world.generate("b", QUESTION) == out_a
    world.scheduler.release("b")
    assert world.generate("ref", [*PROMPT, *QUESTION]) == out_a
    world.scheduler.release("ref")
    engine.drop_handle("sys")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(60)
def test_the_least_recently_used_prefix_is_evicted_and_recomputed_identically() -> None:
    world = Counted(num_blocks=8)  # 32 tokens of KV
    engine = world.engine
    outputs = {}
    for name, rid in [("p1", "a"), ("p2", "b")]:
        prompt = PROMPT[:8] if name == "p1" else PROMPT[4:]
        assert world.run(rid, "prefix", handle=name, tokens=prompt)["hit"] is False
        outputs[name] = world.generate(rid, QUESTION)
        world.scheduler.release(rid)
    # p1 is hit again, so p2 is now the least recently used.
    assert world.run("c", "prefix", handle="p1", tokens=PROMPT[:8])["hit"] is True
    world.scheduler.release("c")
    assert engine.blocks_in_use == 4

    # 24 tokens need 6 blocks; 4 are free: one prefix must go, the older one.
    big = world.generate("big", [3] * 24, n=1)
    assert set(engine.handles) == {"p1"} and big
    world.scheduler.release("big")

    world.tokens = 0
    again = world.run("d", "prefix", handle="p2", tokens=PROMPT[4:])
    assert again == {"tokens": 8, "hit": False} and world.tokens == 8
    assert world.generate("d", QUESTION) == outputs["p2"]
    world.scheduler.release("d")
    for name in list(engine.handles):
        engine.drop_handle(name)
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(60)
def test_a_prefix_in_use_survives_the_eviction_of_its_handle() -> None:
    world = Counted(num_blocks=8)
    engine = world.engine
    assert world.run("live", "prefix", handle="p", tokens=PROMPT[:8])["hit"] is False
    assert engine.blocks_in_use == 2  # handle and fork share them

    out = world.generate("live", QUESTION)  # 14 tokens of KV now: 4 blocks, 2 of them shared

    # 20 tokens need 5 blocks; 4 are free. Evicting the handle frees none (the live fork holds
    # them too), so the big prompt's last chunk waits for the live request.
    big = Job("lm", Step("big", "prefill", {"tokens": [3] * 20}), owner="big")
    world.scheduler.submit(big)
    for _ in range(5):  # its chunks run until the last one does not fit
        assert world.scheduler.run_round() == []
    assert world.scheduler.parked == [big]
    assert engine.handles == {} and engine.blocks_in_use == 8  # the live 4, big's 4
    assert engine.allocator.num_tokens("live") == 14

    world.scheduler.release("live")  # frees the prefix's blocks at last; the big one runs
    done = [outcome for _ in range(10) for job, outcome in world.scheduler.run_round()]
    assert len(done) == 1 and "token" in done[0]
    world.scheduler.release("big")
    assert engine.blocks_in_use == 0
    assert world.generate("ref", [*PROMPT[:8], *QUESTION]) == out
    world.scheduler.release("ref")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(60)
def test_retaining_under_an_existing_handle_replaces_it_and_drop_is_a_step() -> None:
    world = Counted()
    engine = world.engine
    for rid, tokens in [("one", TURN1), ("two", TURN2)]:
        world.generate(rid, tokens, n=1)
        world.run(rid, "retain", handle="s")
        world.scheduler.release(rid)
    assert engine.handles == {"s": ("session", len(TURN2), 2)}
    assert engine.blocks_in_use == 2  # the first one's blocks went back
    assert world.run("x", "drop", handle="s") == {"dropped": True}
    assert engine.blocks_in_use == 0
