"""Prefill ``embeds`` in ``KVCacheEngine``: rows that replace some prompt positions' token
embeddings reach exactly those positions however the prompt is split over forwards, a bad pair
fails its step alone, and a step that waits for memory leaves no row behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_async.engines import Step
from mstar_async.engines.base import WAIT
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.errors import EngineError
from mstar_async.models.qwen3_omni.config import SIZES
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, seeded_init
from mstar_async.models.qwen3_omni.thinker import Thinker

pytestmark = pytest.mark.timeout(60)

VOCAB = 96
PROMPT = [(5 * i + 2) % VOCAB for i in range(23)]
AT = torch.tensor([4, 5, 6, 7, 8, 9, 10, 15])  # a run of placeholders and one stray row


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _thinker() -> Thinker:
    thinker = Thinker(SIZES["tiny"].thinker, VOCAB)
    seeded_init(thinker, 3)
    return thinker.eval()


def _engine(thinker: Thinker, num_blocks: int = 64) -> KVCacheEngine:
    cfg = thinker.config
    return KVCacheEngine(
        thinker,
        cfg.attention_spec(torch.float32),
        num_layers=cfg.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=4,
    )


def _rows(n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, SIZES["tiny"].thinker.hidden_size, generator=gen)


def _dense_first_token(thinker: Thinker, rows: torch.Tensor) -> int:
    with torch.no_grad():
        hidden = thinker(torch.tensor(PROMPT), DenseCausalAttention(len(PROMPT)), embeds=(AT, rows))
        return int(thinker.compute_logits(hidden[-1]).argmax())


def _prefill(engine: KVCacheEngine, request: str, rows: torch.Tensor, budget: int = 0) -> Any:
    step = Step(
        request,
        "prefill",
        {"tokens": torch.tensor(PROMPT), "embeds": rows, "embeds_at": AT},
        budget=budget,
    )
    for _ in range(len(PROMPT) + 1):
        (out,) = engine.forward([step])
        if out is not None:
            return out
    raise AssertionError("the prefill never finished")


def test_rows_reach_their_positions_whole_and_split_over_forwards() -> None:
    thinker = _thinker()
    rows = _rows(len(AT))
    want = _dense_first_token(thinker, rows)
    # Without the rows the answer differs, so the rows are what decides it.
    with torch.no_grad():
        plain = thinker(torch.tensor(PROMPT), DenseCausalAttention(len(PROMPT)))
    assert int(thinker.compute_logits(plain[-1]).argmax()) != want
    for budget in (0, 3, 5, 7):  # splits inside the run of rows and around it
        engine = _engine(thinker)
        assert int(_prefill(engine, "r", rows, budget)["token"]) == want
        assert not engine._sequences["r"].rows  # every row was used and dropped
        engine.release("r")
        assert engine.blocks_in_use == 0


def test_a_second_prefill_of_the_sequence_places_its_rows_after_the_first() -> None:
    thinker = _thinker()
    rows = _rows(len(AT))
    engine = _engine(thinker)
    first = engine.forward([Step("r", "prefill", {"tokens": torch.tensor(PROMPT[:4])})])[0]
    assert first is not None
    rest = Step(
        "r",
        "prefill",
        {"tokens": torch.tensor(PROMPT[4:]), "embeds": rows, "embeds_at": AT - 4},
    )
    (out,) = engine.forward([rest])
    assert isinstance(out, dict) and int(out["token"]) == _dense_first_token(thinker, rows)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"embeds": _rows(2), "embeds_at": torch.tensor([3, 3])}, "increasing offsets"),
        ({"embeds": _rows(2), "embeds_at": torch.tensor([1, 99])}, "increasing offsets"),
        ({"embeds": _rows(3), "embeds_at": torch.tensor([1, 2])}, "one row per"),
        ({"embeds": _rows(2), "embeds_at": None}, "both be tensors"),
    ],
)
def test_a_bad_pair_fails_its_step_alone(inputs: dict[str, Any], message: str) -> None:
    engine = _engine(_thinker())
    bad = Step("bad", "prefill", {"tokens": torch.tensor(PROMPT), **inputs})
    good = Step("good", "prefill", {"tokens": torch.tensor(PROMPT)})
    failed, ok = engine.forward([bad, good])
    assert isinstance(failed, EngineError) and message in str(failed)
    assert isinstance(ok, dict) and "token" in ok
    assert "bad" not in engine._sequences


def test_embeds_on_another_op_or_model_are_refused() -> None:
    engine = _engine(_thinker())
    engine.forward([Step("r", "prefill", {"tokens": torch.tensor(PROMPT[:3])})])
    decode = Step("r", "decode", {"token": 1, "embeds": _rows(1), "embeds_at": torch.tensor([0])})
    (out,) = engine.forward([decode])
    assert isinstance(out, EngineError) and "only prefill" in str(out)


def test_a_step_that_waits_for_memory_keeps_no_rows_and_runs_later() -> None:
    thinker = _thinker()
    rows = _rows(len(AT))
    engine = _engine(thinker, num_blocks=7)  # 28 slots: one prompt of 23 at a time
    holder = engine.forward([Step("holder", "prefill", {"tokens": torch.tensor(PROMPT)})])[0]
    assert isinstance(holder, dict)
    step = Step("r", "prefill", {"tokens": torch.tensor(PROMPT), "embeds": rows, "embeds_at": AT})
    (waited,) = engine.forward([step])
    assert waited is WAIT
    assert not engine._sequences["r"].rows and not engine._sequences["r"].pending
    engine.release("holder")
    (out,) = engine.forward([step])
    assert isinstance(out, dict) and int(out["token"]) == _dense_first_token(thinker, rows)
