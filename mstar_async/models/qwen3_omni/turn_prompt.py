"""The thinker's prompt for a conversation's kept KV, built without encoding anything: what a
``rewind`` cuts a kept conversation back to, and the prefix of a spoken turn prefilled while
the user is still speaking (``warm_prompt``).

Both lay the prompt out exactly as a response does (``audio_prompt.build_prompt``: the same
positions, the same rows at the same placeholders), so what they compute is a true prefix of the
response's prompt wherever the audio is known. A message's audio given as PCM (not yet encoded)
ends what is known: its placeholders' rows are unknown until the response encodes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_async.models.checkpoints import ChatTokenizer
from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoderConfig
from mstar_async.models.qwen3_omni.audio_prompt import (
    AudioTokens,
    Prompt,
    audio_rows,
    build_prompt,
    check_audio,
)

__all__ = ["KnownPrompt", "known_prompt", "placed", "reply_header", "warm_prompt"]


def placed(
    rows: Sequence[torch.Tensor], audio_at: Sequence[int]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A prefill's ``embeds`` and ``embeds_at``: the audio parts' rows (the first
    ``len(rows)`` parts; a part without rows adds none) at their placeholders. Pure."""
    pairs = [(r, a) for r, a in zip(rows, audio_at[: len(rows)], strict=True) if r.shape[0]]
    if not pairs:
        return None, None
    at = [torch.arange(r.shape[0]) + a for r, a in pairs]
    return torch.cat([r for r, _ in pairs]), torch.cat(at)


@dataclass(frozen=True)
class KnownPrompt:
    """A conversation's prompt and its rows placed (the leading run of audio parts given as
    rows); ``known``: where the first part given as PCM starts (the prompt's length when every
    part is rows), past which nothing can match what a response computes."""

    prompt: Prompt
    embeds: torch.Tensor | None
    embeds_at: torch.Tensor | None
    known: int


def known_prompt(
    tokenizer: ChatTokenizer,
    audio_ids: AudioTokens,
    cfg: AudioEncoderConfig | None,
    messages: Sequence[Mapping[str, Any]],
    parts: Sequence[torch.Tensor],
) -> KnownPrompt:
    """The prompt of ``messages`` whose audio ``parts`` (checked, in message order) are rows or
    PCM, as a response lays it out, without encoding the PCM.

    Raises:
        ValueError: the template cannot render the messages; audio without an encoder.
    """
    if parts and cfg is None:
        raise ValueError("this model has no audio encoder; send text only")
    counts = [audio_rows(cfg, a) for a in parts] if cfg is not None else []
    prompt = build_prompt(tokenizer, audio_ids, messages, counts)
    rows = list(itertools.takewhile(lambda a: a.dim() == 2, parts))
    embeds, embeds_at = placed(rows, prompt.audio_at)
    known = prompt.audio_at[len(rows)] if len(rows) < len(parts) else len(prompt.ids)
    return KnownPrompt(prompt, embeds, embeds_at, known)


def reply_header(ids: Sequence[int], im_start: int) -> int:
    """Where the prompt's last ``<|im_start|>`` (the reply's header) starts.

    Raises:
        ValueError: the prompt has none.
    """
    starts = [i for i, t in enumerate(ids) if t == im_start]
    if not starts:
        raise ValueError("the chat template made a prompt without <|im_start|>")
    return starts[-1]


def warm_prompt(
    tokenizer: ChatTokenizer,
    audio_ids: AudioTokens,
    cfg: AudioEncoderConfig | None,
    width: int,
    max_samples: int,
    im_start: int,
    messages: Sequence[Mapping[str, Any]],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The prompt to prefill for a spoken turn still being spoken: ``messages`` is the
    conversation with that turn last, its ``"audio"`` the rows of it the encoder has finished
    (``[n >= 0, width]``). Returns ``tokens``, ``embeds``, ``embeds_at``: the response's prompt
    up to the turn's last finished row (or up to the first audio given as PCM), then the
    reply's header (``<|im_start|>assistant``...), which the talker needs to lay out its
    prompt. What comes before the header is a true prefix of the response's prompt (same
    positions, same rows); the header is not, and a ``resume`` stops where it begins.

    Raises:
        ValueError: no messages; a last message that is not a user turn of rows; audio the
            model cannot take (``check_audio``); the template cannot render the messages.
    """
    if not messages:
        raise ValueError("warm needs messages: the conversation, the turn being spoken last")
    *before, turn = messages
    rows = turn.get("audio")
    if (
        turn.get("role") != "user"
        or not isinstance(rows, torch.Tensor)
        or rows.dim() != 2
        or (rows.shape[0] and rows.shape[1] != width)
    ):
        raise ValueError(
            "warm: the last message is the user turn being spoken, its 'audio' the encoder "
            f"rows heard so far, [n >= 0, {width}]"
        )
    checked = (check_audio(m, cfg, width, max_samples) for m in before)
    parts = [a for a in checked if a is not None] + [rows]
    laid = known_prompt(tokenizer, audio_ids, cfg, messages, parts)
    ids = laid.prompt.ids
    cut = min(laid.known, laid.prompt.audio_at[-1] + rows.shape[0])
    header = reply_header(ids, im_start)
    return torch.tensor(ids[:cut] + ids[header:]), laid.embeds, laid.embeds_at
