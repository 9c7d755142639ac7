"""Batched sampling: greedy, temperature, top-k, top-p and per-request seeds.

The kept sets are checked against an independent float64 computation. Its nucleus is taken
with a slack of NUCLEUS_SLACK on p either way (sampling works in float32, so a cumulative sum
within rounding of p may land on either side): nucleus(p - slack) <= kept <= nucleus(p + slack).
Ties at a cut are kept (the module's documented rule), and the reference keeps them too.

Frequency test: 4000 draws of a 4-token distribution; every frequency within FREQ_ATOL of its
probability (one standard deviation is at most 0.008 at 4000 draws, so 0.03 is ~4 sigma).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.engines import sampling
from mstar_async.engines.sampling import (
    GREEDY_TEMPERATURE,
    SamplingParams,
    make_generator,
    penalize_repeats,
    sample,
)

# No example database: the tests must not write outside their own folders.
PROPERTY = settings(max_examples=80, deadline=None, database=None)
NUCLEUS_SLACK = 1e-4
FREQ_ATOL = 0.03


def make_logits(n: int, vocab: int, seed: int, *, scale: float = 3.0, ties: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen) * scale
    if ties:
        x = (x * 2).round() / 2  # coarse values: many exact ties, also at the cut
    return x


def scaled(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """The row as the sampler sees it: float32, divided by a float32 temperature."""
    return row.to(torch.float32) / torch.tensor(temperature, dtype=torch.float32)


def nucleus_mask(x: torch.Tensor, p: SamplingParams, slack: float) -> torch.Tensor:
    """Independent reference: tokens kept by top-k (ties kept), then by the top-p nucleus
    computed in float64 with ``p.top_p + slack``."""
    vocab = x.shape[0]
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < p.top_k < vocab:
        kth = x.sort(descending=True).values[p.top_k - 1]
        keep &= x >= kth
    target = p.top_p + slack
    if p.top_p < 1.0 and target < 1.0:
        probs = torch.where(keep, x.double(), -math.inf).softmax(-1)
        ranked = probs.sort(descending=True).values
        cum = ranked.cumsum(-1)
        first = int((cum < target).sum().clamp(max=vocab - 1))
        keep &= probs >= ranked[first]
    return keep


def kept_by_module(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The module's kept set per row, from its (private) truncation step."""
    work = x.to(torch.float32).clone()
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    work.div_(temps.unsqueeze(1))
    sampling._truncate_(work, params)
    return work > -math.inf


sampled_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 4.0),
    top_p=st.floats(0.01, 1.0, exclude_min=False),
    top_k=st.integers(0, 40),
)
any_params = st.one_of(
    sampled_params,
    st.builds(SamplingParams, temperature=st.just(0.0), top_k=st.integers(0, 5)),
)


# ---------------------------------------------------------------------------------- greedy


@PROPERTY
@given(
    rows=st.lists(st.builds(SamplingParams, temperature=st.just(0.0)), min_size=1, max_size=8),
    vocab=st.integers(1, 50),
    seed=st.integers(0, 2**31),
    ties=st.booleans(),
)
def test_greedy_equals_argmax(
    rows: list[SamplingParams], vocab: int, seed: int, ties: bool
) -> None:
    x = make_logits(len(rows), vocab, seed, ties=ties)
    assert all(p.greedy for p in rows)
    out = sample(x, rows, [None] * len(rows))
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(-1))
    assert torch.equal(sample(x.bfloat16(), rows, [None] * len(rows)), x.bfloat16().argmax(-1))


def test_temperature_towards_zero_is_greedy() -> None:
    x = make_logits(6, 100, seed=1)
    x[torch.arange(6), x.argmax(-1)] += 0.01  # a gap of >= 0.01 between best and second
    top2 = x.topk(2).values
    assert bool(((top2[:, 0] - top2[:, 1]) >= 0.0099).all())
    for t in (GREEDY_TEMPERATURE / 2, 1e-4):
        params = [SamplingParams(temperature=t)] * 6
        assert params[0].greedy == (t < GREEDY_TEMPERATURE)
        for seed in range(20):
            gens = [make_generator(seed * 10 + i) for i in range(6)]
            assert torch.equal(sample(x, params, gens), x.argmax(-1))


@PROPERTY
@given(
    n=st.integers(1, 6),
    vocab=st.integers(2, 50),
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.1, 5.0),
)
def test_top_k_one_is_greedy(n: int, vocab: int, seed: int, temperature: float) -> None:
    x = make_logits(n, vocab, seed)
    params = [SamplingParams(temperature=temperature, top_k=1)] * n
    assert params[0].greedy
    assert torch.equal(sample(x, params, [make_generator(seed)] * n), x.argmax(-1))


# ---------------------------------------------------------------------------------- cuts


@PROPERTY
@given(
    rows=st.lists(any_params, min_size=1, max_size=8),
    vocab=st.integers(1, 60),
    seed=st.integers(0, 2**31),
    ties=st.booleans(),
)
def test_samples_inside_top_k_and_nucleus(
    rows: list[SamplingParams], vocab: int, seed: int, ties: bool
) -> None:
    x = make_logits(len(rows), vocab, seed, ties=ties)
    gens = [make_generator(seed + i) for i in range(len(rows))]
    for _ in range(3):
        out = sample(x, rows, gens)
        for i, p in enumerate(rows):
            tok = int(out[i])
            if p.greedy:
                assert tok == int(x[i].argmax())
            else:
                assert nucleus_mask(scaled(x[i], p.temperature), p, NUCLEUS_SLACK)[tok]


@PROPERTY
@given(
    rows=st.lists(sampled_params, min_size=1, max_size=8),
    vocab=st.integers(1, 60),
    seed=st.integers(0, 2**31),
    ties=st.booleans(),
)
def test_kept_set_is_the_nucleus(
    rows: list[SamplingParams], vocab: int, seed: int, ties: bool
) -> None:
    rows = [p for p in rows if not p.greedy] or [SamplingParams()]
    x = make_logits(len(rows), vocab, seed, ties=ties)
    kept = kept_by_module(x, rows)
    for i, p in enumerate(rows):
        row = scaled(x[i], p.temperature)
        inner, outer = nucleus_mask(row, p, -NUCLEUS_SLACK), nucleus_mask(row, p, NUCLEUS_SLACK)
        assert bool((inner <= kept[i]).all()) and bool((kept[i] <= outer).all())
        assert kept[i].any()


def test_ties_at_the_cut_are_kept() -> None:
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    kept = kept_by_module(x, [SamplingParams(top_k=2)])
    assert kept[0].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("scale", [0.05, 8.0], ids=["flat-falls-back-to-full-sort", "peaked"])
def test_nucleus_beyond_the_search_window(scale: float) -> None:
    vocab = sampling._NUCLEUS_WINDOW * 3 + 5
    x = make_logits(3, vocab, seed=5, scale=scale)
    rows = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_k=7)]
    kept = kept_by_module(x, rows)
    for i, p in enumerate(rows):
        row = scaled(x[i], p.temperature)
        inner, outer = nucleus_mask(row, p, -NUCLEUS_SLACK), nucleus_mask(row, p, NUCLEUS_SLACK)
        assert bool((inner <= kept[i]).all()) and bool((kept[i] <= outer).all())
    if scale < 1:
        assert int(kept[0].sum()) > sampling._NUCLEUS_WINDOW  # the fallback path really ran
    toks = sample(x, rows, [make_generator(i) for i in range(3)])
    assert all(bool(kept[i, int(t)]) for i, t in enumerate(toks))


# ---------------------------------------------------------------------------------- seeds


@PROPERTY
@given(
    target=sampled_params,
    seed=st.integers(0, 2**63),
    others=st.lists(st.tuples(any_params, st.one_of(st.none(), st.integers(0, 99))), max_size=7),
    shuffle_seed=st.integers(0, 2**31),
)
def test_same_seed_same_tokens_whatever_the_batch(
    target: SamplingParams,
    seed: int,
    others: list[tuple[SamplingParams, int | None]],
    shuffle_seed: int,
) -> None:
    vocab, steps = 40, 6
    rows = make_logits(steps, vocab, seed=shuffle_seed)  # the request's logits at each step
    alone_gen = make_generator(seed)
    alone = [int(sample(rows[s : s + 1], [target], [alone_gen])[0]) for s in range(steps)]
    rng = random.Random(shuffle_seed)
    batched_gen = make_generator(seed)
    other_gens = [None if s is None else make_generator(s) for _, s in others]
    batched = []
    for s in range(steps):
        # Different company each step: a random subset of the others, in random order, with
        # the request at a random position (this also moves it between the top-k window and
        # full-sort code paths, depending on the others' parameters).
        company = [i for i in range(len(others)) if rng.random() < 0.7]
        rng.shuffle(company)
        pos = rng.randint(0, len(company))
        order: list[int | None] = [*company[:pos], None, *company[pos:]]
        x = make_logits(len(order), vocab, seed=rng.randint(0, 2**31))
        x[pos] = rows[s]
        params = [target if i is None else others[i][0] for i in order]
        gens = [batched_gen if i is None else other_gens[i] for i in order]
        batched.append(int(sample(x, params, gens)[pos]))
    assert batched == alone


def test_different_seeds_differ() -> None:
    x = torch.zeros(1, 64)  # uniform over 64 tokens
    params = [SamplingParams()]

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [int(sample(x, params, [gen])[0]) for _ in range(200)]

    a, b = draws(1), draws(2)
    assert draws(1) == a
    # Independent draws agree with probability 1/64: ~3 of 200 expected.
    assert sum(u == v for u, v in zip(a, b, strict=True)) < 20
    assert len(set(a)) > 40


def test_unseeded_rows_sample_too() -> None:
    x = torch.zeros(3, 8)
    x[:, 5] = 50.0  # all the probability on token 5
    params = [SamplingParams(temperature=0.7)] * 3
    assert sample(x, params, [None, make_generator(1), None]).tolist() == [5, 5, 5]


# ---------------------------------------------------------------------------------- frequencies


PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)


def power(probs: torch.Tensor, t: float) -> torch.Tensor:
    w = probs ** (1 / t)
    return w / w.sum()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=2.0), power(PROBS, 2.0)),
        (SamplingParams(temperature=0.5), power(PROBS, 0.5)),
        (SamplingParams(top_k=3), torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9])),
        (SamplingParams(top_p=0.6), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
        (SamplingParams(top_p=0.8, top_k=3), torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9])),
        (SamplingParams(top_p=0.75, top_k=3), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
    ],
    ids=["plain", "t2", "t0.5", "top_k3", "top_p0.6", "top_p0.8+k3", "top_p0.75+k3"],
)
def test_frequencies_match_probabilities(params: SamplingParams, expected: torch.Tensor) -> None:
    draws, batch = 4000, 500
    # A constant offset changes nothing; a permuted vocabulary checks ids are mapped back.
    perm = torch.tensor([2, 0, 3, 1])
    row = torch.empty(4)
    row[perm] = (PROBS.log() + 7.0).float()
    counts = torch.zeros(4)
    for start in range(0, draws, batch):
        gens = [make_generator(start + i) for i in range(batch)]
        out = sample(row.expand(batch, 4).contiguous(), [params] * batch, gens)
        counts += torch.bincount(out, minlength=4).float()
    freq = counts[perm].double() / draws
    assert (freq - expected).abs().max().item() <= FREQ_ATOL
    assert torch.equal(freq == 0, expected == 0)  # cut tokens are never drawn


# ---------------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop_token_ids": frozenset({-3})}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.05}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_normalise_and_describe_greedy() -> None:
    p = SamplingParams(temperature=1, top_p=1, stop_token_ids=[3, 3, 7])  # type: ignore[arg-type]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop_token_ids == frozenset({3, 7})
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop_token_ids=frozenset({3, 7})))


def test_make_generator_and_sample_argument_checks() -> None:
    assert make_generator(5).initial_seed() == 5
    assert make_generator(None).device == torch.device("cpu")
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1)
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="one SamplingParams"):
        sample(x, [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="one SamplingParams"):
        sample(x, [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(4), [SamplingParams()], [None])
    empty = sample(torch.zeros(0, 4), [], [])
    assert empty.shape == (0,) and empty.dtype == torch.int64


# ------------------------------------------------------------------------- repetition penalty


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    # Token 1 twice (penalised once), 7 and -1 outside the vocabulary (ignored).
    seen = torch.tensor([0, 1, 1, 4, 7, -1])
    out = penalize_repeats(logits, seen, 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # a new tensor
    assert penalize_repeats(logits, seen, 1.0) is logits
    assert penalize_repeats(logits, torch.zeros(0, dtype=torch.long), 2.0) is logits


@pytest.mark.parametrize("penalty", [1.05, 1.3, 0.8])
def test_repetition_penalty_equals_transformers_processor(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = make_logits(3, 50, seed=11)
    gen = torch.Generator().manual_seed(12)
    seen = torch.randint(0, 50, (3, 9), generator=gen)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    rows = zip(logits, seen, strict=True)
    mine = torch.stack([penalize_repeats(row, ids, penalty) for row, ids in rows])
    torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    assert not torch.equal(mine, logits)
