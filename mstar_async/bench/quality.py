"""How closely a weight form follows the unquantized model: perplexity on a fixed text, and
greedy agreement on fixed prompts.

- **Perplexity**: ``prompts/perplexity_en.txt`` (about 5.6 KB of plain English prose written for
  this benchmark and given to the public domain), tokenized whole and run as one causal
  sequence (in windows of the model's positions, if it has fewer); ``exp`` of the mean negative
  log-likelihood of every token after the first, the log-softmax taken in float32.
- **Greedy agreement**: the 16 prompts of ``prompts/agreement_en.txt``, 32 new tokens each,
  greedy, EOS ignored, through the paged engine (one prefill forward, then decode rounds of all
  16). ``greedy_agreement`` is the share of the 512 tokens equal to the reference's token at the
  same place; ``identical`` counts the prompts whose 32 tokens all match. ``next_token`` is the
  teacher-forced agreement: each form reads the prompt followed by the *reference's* tokens,
  and its argmax at each of the 32 places is compared with the reference's token there, so one
  early divergence does not decide the rest.

The model is driven directly for perplexity and next-token agreement (every position's logits,
attention over the sequence itself, no cache), and through a ``KVCacheEngine`` for greedy
continuations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mstar_async.engines.base import Step
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.models.checkpoints import ChatTokenizer
from mstar_async.models.llama import QUANTIZED_HEAD_MAX_ROWS, PagedDecoder

__all__ = [
    "AGREEMENT_PROMPTS",
    "PERPLEXITY_TEXT",
    "Quality",
    "SequenceAttention",
    "agreement_prompts",
    "compare",
    "greedy_continuations",
    "next_token_log_probs",
    "perplexity",
    "perplexity_ids",
    "teacher_forced_argmax",
]

_PROMPTS = Path(__file__).resolve().parent / "prompts"
PERPLEXITY_TEXT = _PROMPTS / "perplexity_en.txt"
AGREEMENT_PROMPTS = _PROMPTS / "agreement_en.txt"

# Rows of logits turned into log-probabilities at once (a [rows, vocab] float32 block): as
# many as one decode round of a few requests, so a quantized head is measured in the form that
# serves them (past that many rows the decoder multiplies the float embedding instead).
_LOGIT_ROWS = QUANTIZED_HEAD_MAX_ROWS


class SequenceAttention:
    """Causal attention of one sequence over its own tokens (no cache): the ``PagedAttention``
    seam for a whole-sequence forward of ``PagedDecoder``."""

    def __init__(self, length: int, device: torch.device) -> None:
        self._positions = torch.arange(length, device=device)

    @property
    def positions(self) -> torch.Tensor:
        """``0 .. length - 1``."""
        return self._positions

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q`` ``[n, heads, d]`` over ``k`` / ``v`` ``[n, kv_heads, d]``, causal, groups of
        query heads sharing a kv head; ``[n, heads, d]``. Never raises on those shapes."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


def _logits_rows(model: PagedDecoder, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every position's float32 logits, in blocks of ``_LOGIT_ROWS`` rows."""
    with torch.inference_mode():
        hidden = model(ids, SequenceAttention(len(ids), ids.device))
        return [
            model.compute_logits(hidden[start : start + _LOGIT_ROWS]).float()
            for start in range(0, len(ids), _LOGIT_ROWS)
        ]


def next_token_log_probs(model: PagedDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The log-probability ``model`` gives each token of ``ids`` after the first, from the
    tokens before it: ``[len(ids) - 1]`` float32. One forward; blocks.

    Raises:
        ValueError: fewer than two tokens, or more than the model's positions.
    """
    if not 2 <= len(ids) <= model.config.max_position_embeddings:
        raise ValueError(f"need 2 to {model.config.max_position_embeddings} tokens, got {len(ids)}")
    rows = torch.cat([torch.log_softmax(block, dim=-1) for block in _logits_rows(model, ids)])
    return rows[:-1].gather(1, ids[1:].unsqueeze(1)).squeeze(1)


def perplexity(model: PagedDecoder, ids: torch.Tensor) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids`` after the first token. A text
    longer than the model's positions is scored in consecutive windows of that many tokens,
    each read on its own (its first token is not scored). Blocks.

    Raises:
        ValueError: fewer than two tokens.
    """
    window = model.config.max_position_embeddings
    pieces = [ids[start : start + window] for start in range(0, len(ids), window)]
    scored = [next_token_log_probs(model, piece) for piece in pieces if len(piece) >= 2]
    if not scored:
        raise ValueError(f"need at least 2 tokens, got {len(ids)}")
    return float(torch.exp(-torch.cat(scored).double().mean()))


def teacher_forced_argmax(
    model: PagedDecoder, prompt: Sequence[int], given: Sequence[int]
) -> list[int]:
    """``model``'s greedy choice at each place of ``given`` when it reads ``prompt`` and then
    ``given`` itself (one forward). Blocks.

    Raises:
        ValueError: an empty ``prompt`` or ``given``.
    """
    if not prompt or not given:
        raise ValueError("teacher forcing needs a prompt and at least one given token")
    ids = torch.tensor([*prompt, *given[:-1]], dtype=torch.long)
    rows = torch.cat(_logits_rows(model, ids))[len(prompt) - 1 :]
    return [int(t) for t in rows.argmax(dim=-1)]


def greedy_continuations(
    engine: KVCacheEngine, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[list[int]]:
    """``new_tokens`` greedy tokens after each prompt (EOS ignored), all prompts as one batch:
    one prefill forward, then decode rounds. Blocks; releases the requests before returning.

    Raises:
        ValueError: a step did not return a token (a KV cache too small for the batch).
    """
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, stop_token_ids=frozenset())
    ids = [f"quality-{i}" for i in range(len(prompts))]
    steps = [
        Step(
            rid,
            "prefill",
            {"tokens": torch.tensor(list(p), dtype=torch.long), "sampling": sampling},
        )
        for rid, p in zip(ids, prompts, strict=True)
    ]
    tokens: list[list[int]] = [[] for _ in prompts]
    try:
        for _ in range(new_tokens):
            results = engine.forward(steps)
            for out, result in zip(tokens, results, strict=True):
                if not isinstance(result, dict) or "token" not in result:
                    raise ValueError(f"a greedy step returned {result!r}, not a token")
                out.append(int(result["token"]))
            steps = [
                Step(rid, "decode", {"token": torch.tensor(t[-1])})
                for rid, t in zip(ids, tokens, strict=True)
            ]
    finally:
        for rid in ids:
            engine.release(rid)
    return tokens


@dataclass(frozen=True, slots=True)
class Quality:
    """A form's quality against the reference (see the module docstring)."""

    perplexity: float
    perplexity_ratio: float  # this form's perplexity / the reference's
    greedy_agreement: float
    identical: int
    next_token: float
    prompts: int
    new_tokens: int

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {
            "perplexity": round(self.perplexity, 4),
            "perplexity_ratio": round(self.perplexity_ratio, 5),
            "greedy_agreement": round(self.greedy_agreement, 4),
            "identical_continuations": self.identical,
            "next_token_agreement": round(self.next_token, 4),
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
        }


def compare(
    *,
    perplexity_value: float,
    reference_perplexity: float,
    greedy: Sequence[Sequence[int]],
    reference_greedy: Sequence[Sequence[int]],
    forced: Sequence[Sequence[int]],
) -> Quality:
    """A form's ``Quality`` from its measurements and the reference's (``forced``: its
    teacher-forced argmax along the reference's continuations).

    Raises:
        ValueError: ``greedy``, ``reference_greedy`` and ``forced`` differ in shape.
    """
    shapes = {tuple(len(s) for s in seqs) for seqs in (greedy, reference_greedy, forced)}
    if len(shapes) != 1 or not greedy:
        raise ValueError("greedy, reference and teacher-forced tokens must have one shape")
    pairs = [
        (a, b)
        for got, want in zip(greedy, reference_greedy, strict=True)
        for a, b in zip(got, want, strict=True)
    ]
    forced_pairs = [
        (a, b)
        for got, want in zip(forced, reference_greedy, strict=True)
        for a, b in zip(got, want, strict=True)
    ]
    return Quality(
        perplexity=perplexity_value,
        perplexity_ratio=perplexity_value / reference_perplexity,
        greedy_agreement=sum(a == b for a, b in pairs) / len(pairs),
        identical=sum(
            list(got) == list(want) for got, want in zip(greedy, reference_greedy, strict=True)
        ),
        next_token=sum(a == b for a, b in forced_pairs) / len(forced_pairs),
        prompts=len(greedy),
        new_tokens=len(greedy[0]),
    )


def perplexity_ids(tokenizer: ChatTokenizer) -> torch.Tensor:
    """The perplexity text's token ids. Raises ``OSError`` if the file is missing."""
    return torch.tensor(
        tokenizer.encode(PERPLEXITY_TEXT.read_text(encoding="utf-8")), dtype=torch.long
    )


def agreement_prompts(tokenizer: ChatTokenizer) -> list[list[int]]:
    """The agreement prompts' token ids, one list per line. Raises ``OSError`` if the file is
    missing."""
    lines = AGREEMENT_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [tokenizer.encode(line) for line in lines if line.strip()]
