"""Query tokens over a cached prefix: non-causal paged layouts, and the KV engine's fork,
extend and attend ops (attend leaves no trace; extend stays; branches are freed with their
request)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines.base import WAIT, Step
from mstar_async.engines.kv import AttentionSpec, BatchLayout, TorchAttentionBackend
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.errors import EngineError, KVCacheFull
from mstar_async.models.bagel import bagel_config
from mstar_async.models.bagel.mot import BagelLM
from tests.engines.kv_harness import World

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _full_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SPEC.softmax_scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prefixes", [(0,), (5, 0, 9), (4, 4, 13), (1, 30)])
def test_non_causal_layout_attends_to_the_whole_prefix_and_every_new_token(
    prefixes: tuple[int, ...],
) -> None:
    world = World(SPEC, TorchAttentionBackend(SPEC, "cpu"), num_layers=1)
    seqs = [f"s{i}" for i in range(len(prefixes))]
    for seq in seqs:
        world.add(seq)
    world.fork(seqs[0], "fork")  # shares the first prefix: the CoW path runs too
    first = {s: p for s, p in zip(seqs, prefixes, strict=True) if p}
    if first:
        world.step(first)
    new = {s: 3 + i for i, s in enumerate([*seqs, "fork"])}
    plans = world.alloc.append_batch(new)
    world.cache.copy_blocks([c for p in plans for c in p.copies])
    layout = BatchLayout.from_plans(world.alloc, plans, causal=False)
    meta = world.backend.plan(layout)
    n = layout.num_query_tokens
    q, k, v = (torch.randn(n, h, 8) for h in (4, 2, 2))
    world.cache.write(0, meta.slot_mapping, k, v)
    out = world.backend.forward(q, world.cache.key(0), world.cache.value(0), meta)
    start = 0
    for seq, q_len in zip(layout.seq_ids, layout.query_lens, strict=True):
        hk, hv = world.history[seq][0]
        keys = torch.cat([hk, k[start : start + q_len].double()])
        values = torch.cat([hv, v[start : start + q_len].double()])
        ref = _full_reference(q[start : start + q_len], keys, values)
        assert (out[start : start + q_len].double() - ref).abs().max() < 1e-5
        start += q_len


def _engine(num_blocks: int = 64) -> tuple[KVCacheEngine, BagelLM]:
    lm = BagelLM(bagel_config("tiny"))
    spec = lm.language_model.attention_spec()
    return KVCacheEngine(lm, spec, num_layers=2, num_blocks=num_blocks), lm


def _attend(request: str, seq: str, seed: int = 0) -> Step:
    latent = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
    return Step(request, "attend", {"seq": seq, "latent": latent, "t": torch.tensor(0.5)})


@pytest.mark.timeout(30)
def test_attend_leaves_the_sequence_as_it_was_and_repeats_exactly() -> None:
    engine, _ = _engine()
    engine.forward([Step("r", "prefill", {"tokens": list(range(20))})])
    engine.forward([Step("r", "fork", {"seq": "a"}), Step("r", "fork", {"seq": "b"})])
    held = engine.blocks_in_use
    assert held == 2  # 20 tokens; the forks share both blocks
    out1 = engine.forward([_attend("r", "a"), _attend("r", "b")])
    out2 = engine.forward([_attend("r", "b"), _attend("r", "a")])
    assert engine.blocks_in_use == held
    assert engine.allocator.num_tokens(("r", "a")) == 20
    # Same prefix, same latent: the two branches agree, and nothing stayed behind.
    for first, second in [(out1[0], out2[1]), (out1[1], out2[0]), (out1[0], out1[1])]:
        assert isinstance(first, dict) and isinstance(second, dict)
        assert torch.equal(first["velocity"], second["velocity"])
    # Two shared partial blocks copied, two fresh ones for the latents, all freed after.
    assert engine.peak_blocks_in_use == held + 2 * 2
    engine.release("r")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(30)
def test_extend_keeps_its_tokens_and_changes_what_attend_sees() -> None:
    engine, lm = _engine()
    engine.forward([Step("r", "prefill", {"tokens": [1, 2, 3]})])
    engine.forward([Step("r", "fork", {"seq": "before"})])
    before = engine.forward([_attend("r", "before")])[0]
    embeds = torch.randn(8, lm.cfg.hidden)
    (result,) = engine.forward([Step("r", "extend", {"embeds": embeds})])
    assert isinstance(result, dict) and int(result["length"]) == 8
    assert engine.allocator.num_tokens("r") == 11
    engine.forward([Step("r", "fork", {"seq": "after"})])
    after = engine.forward([_attend("r", "after")])[0]
    assert isinstance(before, dict) and isinstance(after, dict)
    assert (before["velocity"] - after["velocity"]).abs().max() > 1e-4
    engine.release("r")
    assert engine.blocks_in_use == 0


@pytest.mark.timeout(30)
def test_fork_and_attend_report_bad_use() -> None:
    engine, _ = _engine()
    (missing,) = engine.forward([_attend("r", "nope")])
    assert isinstance(missing, EngineError) and "does not exist" in str(missing)
    (bad,) = engine.forward([Step("r", "attend", {"seq": "nope"})])
    assert isinstance(bad, EngineError) and "latent" in str(bad)
    (forked,) = engine.forward([Step("r", "fork", {"seq": "x", "parent": "missing"})])
    assert isinstance(forked, EngineError) and "does not exist" in str(forked)
    engine.forward([Step("r", "fork", {"seq": "x"})])  # from the empty main sequence
    (again,) = engine.forward([Step("r", "fork", {"seq": "x"})])
    assert isinstance(again, EngineError) and "already exists" in str(again)
    with pytest.raises(EngineError, match="no op 'bogus'"):
        engine.forward([Step("r", "bogus", {})])
    engine.release("r")
    assert len(engine.allocator) == 0


@pytest.mark.timeout(30)
def test_attend_waits_while_another_request_holds_memory() -> None:
    engine, _ = _engine(num_blocks=4)
    engine.forward([Step("r", "prefill", {"tokens": list(range(20))})])
    engine.forward([Step("q", "prefill", {"tokens": list(range(20))})])
    engine.forward([Step("r", "fork", {"seq": "a"})])
    # Its partial block's copy and one more block: 2 needed, none free, but q may release 2.
    (waiting,) = engine.forward([_attend("r", "a")])
    assert waiting is WAIT and engine.blocks_in_use == 4  # the scratch fork is gone
    engine.release("q")
    (ran,) = engine.forward([_attend("r", "a")])
    assert isinstance(ran, dict) and engine.blocks_in_use == 2
    engine.release("r")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0


@pytest.mark.timeout(30)
def test_attend_that_never_fits_next_to_its_own_prefix_fails_naming_the_sizes() -> None:
    engine, _ = _engine(num_blocks=3)
    engine.forward([Step("r", "prefill", {"tokens": list(range(20))})])
    engine.forward([Step("r", "fork", {"seq": "a"}), Step("r", "fork", {"seq": "b"})])
    results = engine.forward([_attend("r", "a"), _attend("r", "b")])
    # 36 tokens would fit 3 blocks, but the prompt's 2 blocks stay held by r's own sequences:
    # 1 block can ever be free and each attend needs 2, so waiting would never end.
    for result in results:
        assert isinstance(result, KVCacheFull)
        assert "attend needs 2 more blocks for 16 tokens but only 1 of the cache's 3" in str(result)
    assert engine.blocks_in_use == 2
    engine.release("r")
    engine.forward([Step("s", "prefill", {"tokens": list(range(40))})])
    engine.forward([Step("s", "fork", {"seq": "a"})])
    (full,) = engine.forward([_attend("s", "a")])
    assert isinstance(full, KVCacheFull) and "needs KV for 56 tokens" in str(full)


class _Toy(torch.nn.Module):
    """One attention layer with K/V straight from an embedding: cheap enough for hypothesis."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 4 * 8)

    def _attend(self, x: torch.Tensor, attention: Any) -> torch.Tensor:
        n = x.shape[0]
        q = x.view(n, 4, 8)
        out: torch.Tensor = attention(0, q, q[:, :2].contiguous(), q[:, 2:].contiguous())
        return out.reshape(n, -1)

    def forward(self, input_ids: torch.Tensor, attention: Any) -> torch.Tensor:
        return self._attend(self.embed(input_ids), attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, :50]

    def query_length(self, inputs: Mapping[str, Any]) -> int:
        return int(inputs["x"].shape[0])

    def forward_queries(
        self, op: str, inputs: Sequence[Mapping[str, Any]], attention: Any
    ) -> list[dict[str, Any]]:
        lengths = [self.query_length(i) for i in inputs]
        out = self._attend(torch.cat([i["x"] for i in inputs]), attention)
        return [{"y": y} for y in out.split(lengths)]


_OPS = st.sampled_from(["prefill", "fork", "extend", "attend", "release"])


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None)
@given(
    program=st.lists(
        st.tuples(_OPS, st.sampled_from(["r", "s"]), st.sampled_from(["a", "b", ""])),
        max_size=25,
    ),
    sizes=st.lists(st.integers(1, 20), min_size=25, max_size=25),
)
def test_any_mix_of_query_ops_keeps_the_pool_consistent_and_leaks_nothing(
    program: list[tuple[str, str, str]], sizes: list[int]
) -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    engine = KVCacheEngine(_Toy(), spec, num_layers=1, num_blocks=12, block_size=4)
    for (op, request, seq), n in zip(program, sizes, strict=False):
        if op == "release":
            engine.release(request)
        else:
            inputs: dict[str, Any] = {"seq": seq} if seq else {}
            if op == "prefill":
                inputs["tokens"] = list(range(n))
            elif op == "fork":
                inputs = {"seq": seq or "a"}
            else:
                inputs["x"] = torch.randn(n, 32)
            held = engine.blocks_in_use
            (result,) = engine.forward([Step(request, op, inputs)])
            if op == "attend":
                assert engine.blocks_in_use == held  # attend never keeps a block
            assert not isinstance(result, Exception) or isinstance(
                result, EngineError | KVCacheFull
            )
        engine.allocator.check_invariants()
    engine.release("r")
    engine.release("s")
    assert engine.blocks_in_use == 0 and len(engine.allocator) == 0
