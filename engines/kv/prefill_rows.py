"""Prefill rows (embeddings that replace some prompt positions' token embeddings): the check a
step's ``embeds`` / ``embeds_at`` pass, and what a sequence's tokens *are*, for deciding how
much of a kept sequence a new prompt shares: a token id, or, at a position whose embedding a
prefill replaced with a row (audio, image), the id together with a digest of that row, so two
prompts with the same placeholders but different audio do not match.

Pure (no engine state); the digest reads the rows on the host.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import torch

from mstar_async.engines.base import Step
from mstar_async.errors import EngineError

__all__ = ["check_embeds", "common_prefix", "prompt_keys"]


def _count(tokens: object) -> int:
    if isinstance(tokens, torch.Tensor):
        return int(tokens.numel())
    if isinstance(tokens, int):
        return 1
    return len(tokens) if isinstance(tokens, (list, tuple)) else 0


def check_embeds(step: Step, accepts: bool) -> EngineError | None:
    """Whether a token step's ``embeds`` / ``embeds_at`` can be used (``accepts``: the model
    takes rows), checked before any of its tokens are taken; the error fails that step alone."""
    rows, at = step.inputs.get("embeds"), step.inputs.get("embeds_at")
    if rows is None and at is None:
        return None
    where = f"request {step.request_id}: {step.op}"
    if step.op not in ("prefill", "rewind"):
        return EngineError(f"{where} cannot take embeds; only prefill (and rewind) do")
    if not accepts:
        return EngineError(f"{where}: the model takes no embeds")
    if not isinstance(rows, torch.Tensor) or not isinstance(at, torch.Tensor):
        return EngineError(f"{where}: embeds and embeds_at must both be tensors")
    n = _count(step.inputs.get("tokens", ()))
    offsets = at.reshape(-1).long()
    if rows.dim() != 2 or rows.shape[0] != offsets.numel():
        return EngineError(
            f"{where}: embeds must be [m, hidden] with one row per embeds_at offset, got "
            f"{tuple(rows.shape)} for {offsets.numel()} offsets"
        )
    if offsets.numel() and (
        int(offsets[0]) < 0 or int(offsets[-1]) >= n or bool((offsets[1:] <= offsets[:-1]).any())
    ):
        return EngineError(f"{where}: embeds_at must be increasing offsets into its {n} tokens")
    return None


def prompt_keys(
    tokens: Sequence[int], rows: torch.Tensor | None, at: torch.Tensor | None
) -> list[Hashable]:
    """One key per token of a prefill: the id, or ``(id, digest of its row)`` at an offset of
    ``at`` (the ``j``-th offset takes ``rows[j]``). Each row is digested alone, so a prompt
    that adds rows after the kept ones (a new spoken turn) still shares every earlier one.
    Never raises on a pair the engine accepted."""
    keys: list[Hashable] = list(tokens)
    if rows is None or at is None or not rows.numel():
        return keys
    data = rows.detach().to("cpu", torch.float32).contiguous().numpy()
    for j, offset in enumerate(at.reshape(-1).tolist()):
        digest = hashlib.blake2b(data[j].tobytes(), digest_size=16).hexdigest()
        keys[int(offset)] = (tokens[int(offset)], digest)
    return keys


def common_prefix(kept: Sequence[Hashable], new: Sequence[Hashable]) -> int:
    """How many leading keys ``kept`` and ``new`` share."""
    n = 0
    for a, b in zip(kept, new, strict=False):
        if a != b:
            break
        n += 1
    return n
