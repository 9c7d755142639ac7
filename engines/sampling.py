"""Batched next-token sampling: greedy, temperature, top-k and top-p, with per-request seeds;
and transformers' repetition penalty for samplers that know the tokens already generated.

One call samples every row of a step's logits. Greedy rows take the argmax. Other rows are
divided by their temperature, cut to their top-k and then to their top-p nucleus, and drawn
by inverse-CDF sampling with **one** uniform number from the row's own generator. A row's
token therefore depends only on its logits, its parameters and its generator, never on which
other rows share the batch or where the row sits in it: a seeded request is reproducible.

Ties: a cut keeps every token whose (temperature-scaled) logit equals the last kept one, so
top-k may keep more than ``k`` tokens when logits tie, and the kept set never depends on how a
sort ordered equal values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GREEDY_TEMPERATURE",
    "SamplingParams",
    "make_generator",
    "penalize_repeats",
    "sample",
]

# Temperatures below this sample as greedy: dividing logits by a tinier number overflows
# float32 to inf, and the distribution is one-hot to float32 precision long before that.
GREEDY_TEMPERATURE = 1e-5

_SEED_LIMIT = 2**64

# Ranks searched for a top-p nucleus before falling back to sorting the whole row.
_NUCLEUS_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens.

    Attributes:
        temperature: >= 0; 0 (anything below :data:`GREEDY_TEMPERATURE`) means greedy.
        top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (1 keeps all).
        top_k: >= 0; keep the ``top_k`` most likely tokens (0 keeps all).
        seed: ``None`` or an int in [0, 2**64); seeds the request's generator
            (see :func:`make_generator`).
        max_tokens: >= 1; most tokens to generate.
        stop_token_ids: tokens that end the request (any iterable of ints >= 0 is accepted and
            stored as a frozenset).
        repetition_penalty: > 0; 1 is off. Applied by a sampler that is given the tokens
            already generated (:func:`penalize_repeats`), before temperature and the cuts;
            ``sample`` itself knows no history and ignores it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        """Check every field and normalise ``temperature`` / ``top_p`` to float and
        ``stop_token_ids`` to a frozenset.

        Raises:
            ValueError: a field is of the wrong type or outside its range; the message names
                the field and the allowed range.
        """
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not (0 <= t < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {s!r}")
        if s is not None and not 0 <= s < _SEED_LIMIT:
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {s!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {m!r}")
        try:
            stops = frozenset(self.stop_token_ids)
        except TypeError:
            raise ValueError(
                f"stop_token_ids must be a collection of ints >= 0, got {self.stop_token_ids!r}"
            ) from None
        bad = [x for x in stops if isinstance(x, bool) or not isinstance(x, int) or x < 0]
        if bad:
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {sorted(map(repr, bad))}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not (0 < r < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        # Frozen dataclass: normalising needs object.__setattr__.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "repetition_penalty", float(r))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """Whether rows with these parameters take the argmax (temperature below
        :data:`GREEDY_TEMPERATURE`, or ``top_k == 1``); they then use no randomness."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a generator on ``device`` seeded with ``seed``, or non-deterministically when
    ``seed`` is None.

    Give each sampling request its own generator and pass it to :func:`sample` on every step;
    with the same seed the request then draws the same tokens whatever else is batched.

    Raises:
        ValueError: ``seed`` is not None and not an int in [0, 2**64).
    """
    gen = torch.Generator(device=torch.device(device))
    if seed is None:
        gen.seed()
        return gen
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    return gen.manual_seed(seed)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` (``[..., vocab]``) with the logit of every token in ``seen`` penalised once,
    as transformers' ``RepetitionPenaltyLogitsProcessor`` does: divided by ``penalty`` where
    positive, multiplied where negative. Ids outside the vocabulary are ignored. A new tensor
    (``logits`` itself when ``penalty`` is 1 or nothing was seen); raises nothing.
    """
    vocab = logits.shape[-1]
    ids = seen.reshape(-1).to(device=logits.device, dtype=torch.int64)
    ids = ids[(ids >= 0) & (ids < vocab)]
    if penalty == 1.0 or not ids.numel():
        return logits
    repeated = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
    repeated[ids] = True
    punished = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(repeated, punished, logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (``[n, vocab]``); return ``[n]`` int64 on its device.

    Greedy rows (:attr:`SamplingParams.greedy`) take the first maximal logit. Other rows, in
    float32: divide by temperature, keep the top-k, then the top-p nucleus (the smallest set of
    most likely tokens whose probability reaches ``top_p``; at least one token), and draw with
    one uniform number from the row's generator (``None`` uses the global RNG and is not
    reproducible). Generators must be on the logits' device.

    Raises:
        ValueError: ``logits`` is not 2-D with at least one column, or ``params`` /
            ``generators`` do not have one entry per row.
    """
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [n, vocab] with vocab >= 1, got {tuple(logits.shape)}")
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(
            f"need one SamplingParams and one generator per row: {n} rows, {len(params)} "
            f"params, {len(generators)} generators"
        )
    device = logits.device
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    temps = torch.tensor([p.temperature for p in chosen], dtype=torch.float32, device=device)
    # index_select copies, so every step below may work in place on our own float32 buffer
    # (at 256 x 150k logits, fresh allocations per pass cost as much as the passes).
    x = logits.index_select(0, index).to(torch.float32)
    x.div_(temps.unsqueeze(1))
    _truncate_(x, chosen)
    picked = _draw_(x, _uniforms([generators[i] for i in rows], device))
    tokens.index_copy_(0, index, picked)
    return tokens


def _truncate_(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    # Both cuts are thresholds on the logit value: top-k keeps x >= (k-th largest value), top-p
    # keeps x >= (value of the last token of the nucleus). Only sorted *values* are used, and
    # they are the same however a sort orders ties, so the kept set is batch-independent.
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ps = [p.top_p for p in params]
    unbounded = [p < 1.0 and not k for p, k in zip(ps, ks, strict=True)]
    need_p = any(p < 1.0 for p in ps)
    if not any(ks) and not need_p:
        return
    device = x.device
    width = max(ks)
    if any(unbounded):
        # A nucleus without a top-k bound may reach deep into the vocabulary, but usually
        # does not: look in a window first and sort whole rows only where it falls short.
        width = min(vocab, max(width, _NUCLEUS_WINDOW))
    ranked = _ranked(x, width)
    neg_inf = torch.tensor(-math.inf, device=device)
    k_t = torch.tensor(ks, dtype=torch.int64, device=device).unsqueeze(1)
    threshold = torch.where(k_t > 0, ranked.gather(1, (k_t - 1).clamp(min=0)), neg_inf)
    if any(ks):
        x.masked_fill_(x < threshold, -math.inf)
    if not need_p:
        return
    ranked.masked_fill_(ranked < threshold, -math.inf)
    # Normalise over every kept token of the row, not just the window: a window may cut off
    # ties of its last value, which still belong to the distribution.
    lse = x.logsumexp(dim=-1, keepdim=True)
    p_t = torch.tensor(ps, dtype=torch.float32, device=device).unsqueeze(1)
    nucleus, reached = _nucleus(ranked, lse, p_t)
    if width < vocab:
        flags = torch.tensor(unbounded, dtype=torch.bool, device=device).unsqueeze(1)
        short = (flags & ~reached).squeeze(1).nonzero().squeeze(1)
        if short.numel():  # host sync, only when some unbounded top-p row exists
            full = _ranked(x.index_select(0, short), vocab)
            again, _ = _nucleus(full, lse.index_select(0, short), p_t.index_select(0, short))
            nucleus.index_copy_(0, short, again)
    nucleus = torch.where(p_t < 1.0, nucleus, neg_inf)
    x.masked_fill_(x < torch.maximum(threshold, nucleus), -math.inf)


def _ranked(x: torch.Tensor, width: int) -> torch.Tensor:
    # The ``width`` largest values of each row, descending.
    if width >= x.shape[1]:
        return x.sort(dim=-1, descending=True).values
    return x.topk(width, dim=-1, sorted=True).values


def _nucleus(
    ranked: torch.Tensor, lse: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Value of the first rank whose cumulative probability reaches p, and whether the ranks
    # given reached p at all. When rounding keeps the sum below p everywhere, the index runs
    # to the end: a -inf there, or the smallest kept value, which cuts nothing.
    cum = (ranked - lse).exp_().cumsum_(dim=-1)
    last = (cum < p).sum(dim=-1, keepdim=True).clamp_(max=ranked.shape[1] - 1)
    return ranked.gather(1, last), cum[:, -1:] >= p


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    # Exactly one number per row from the row's own generator, so a request's random stream
    # advances the same way whatever it is batched with.
    count = sum(g is None for g in generators)
    shared = iter(torch.rand(count, device=device).unbind()) if count else iter(())
    parts = [
        next(shared) if gen is None else torch.rand((), generator=gen, device=device)
        for gen in generators
    ]
    return torch.stack(parts)


def _draw_(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # Inverse CDF in vocabulary order over unnormalised weights exp(x - max): token j is drawn
    # when cum[j-1] <= u * total < cum[j], i.e. with probability w[j] / total. Zero-weight
    # tokens leave cum flat, so the search (right=True) never lands on them; the minimum with
    # the first index reaching the total covers u * total rounding up to the total.
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    cum = x.cumsum_(dim=-1)
    total = cum[:, -1:].contiguous()
    picked = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True)
    last_positive = torch.searchsorted(cum, total)
    return torch.minimum(picked, last_positive).squeeze(1)
