"""The thinker's prompt with speech in it: audio placeholders laid out as upstream's processor
lays them out, and the checks a request's audio passes before any work is done.

A user message may carry ``"audio"`` beside its ``"content"``: 16 kHz PCM (a 1-D tensor, float
in [-1, 1] or int16), encoded by the request, or rows the audio encoder already made (a 2-D
tensor ``[n, hidden]``, e.g. from an ``encode_only`` request that heard the user while they
spoke). In the prompt the audio comes first in its message's content, as
``<|audio_start|> <|audio_pad|> x n <|audio_end|>`` followed by the text, which is what
Qwen3-Omni's chat template and processor make of ``[{"type": "audio"}, {"type": "text"}]``;
``n`` is the encoder's output length for ``samples // 160`` mel frames (upstream's
``_get_feat_extract_output_lengths``). The thinker's prefill then takes the encoder's rows in
place of the ``audio_pad`` embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_async.models.checkpoints import ChatTokenizer
from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoderConfig
from mstar_async.models.qwen3_omni.audio_features import HOP, SAMPLE_RATE

__all__ = [
    "MIN_SAMPLES",
    "AudioTokens",
    "Prompt",
    "audio_tokens",
    "build_prompt",
    "check_audio",
    "pcm_piece",
]

#: The shortest utterance the features take (the STFT's reflection at each end reads 201).
MIN_SAMPLES = 201
# Stands for an audio part in the rendered template; a private-use character no text carries.
_SLOT = "\U000f0000"


@dataclass(frozen=True)
class AudioTokens:
    """The thinker's ids around and inside an audio part."""

    start: int
    pad: int
    end: int


def audio_tokens(
    start: int | None, pad: int | None, end: int | None, tokenizer: ChatTokenizer
) -> AudioTokens:
    """The audio ids: the config's where it names them, else the tokenizer's
    ``<|audio_start|>`` / ``<|audio_pad|>`` / ``<|audio_end|>``, else (a seeded model over a
    tokenizer without them) the three ids after the tts ids past the vocabulary. Pure."""
    base = tokenizer.vocab_size + 3
    found = [
        given if given is not None else tokenizer.token_to_id(name)
        for given, name in (
            (start, "<|audio_start|>"),
            (pad, "<|audio_pad|>"),
            (end, "<|audio_end|>"),
        )
    ]
    return AudioTokens(*(base + i if v is None else int(v) for i, v in enumerate(found)))


def pcm_piece(piece: Any) -> torch.Tensor:
    """One piece of 16 kHz speech as float32 samples in [-1, 1] (int16 is scaled by 1/32768).

    Raises:
        ValueError: not a 1-D tensor of float or int16 samples (the message says the fix).
    """
    if not isinstance(piece, torch.Tensor) or piece.dim() != 1:
        shape = tuple(piece.shape) if isinstance(piece, torch.Tensor) else type(piece).__name__
        raise ValueError(
            f"speech must be mono 16 kHz PCM, a 1-D tensor of samples; got {shape} (resample "
            "to 16 kHz and pass one channel)"
        )
    if piece.dtype == torch.int16:
        return piece.float() / 32768.0
    if not piece.dtype.is_floating_point:
        raise ValueError(f"speech samples must be float in [-1, 1] or int16, got {piece.dtype}")
    return piece.float()


def check_audio(
    message: Mapping[str, Any], cfg: AudioEncoderConfig | None, width: int, max_samples: int
) -> torch.Tensor | None:
    """The audio of one message, checked before any work: 16 kHz PCM (float32) or encoder
    rows; ``None`` when it has none.

    Raises:
        ValueError: audio on a model without an audio encoder or in a message that is not
            the user's; a sample rate other than
            16 kHz; PCM of another shape or type, shorter than ``MIN_SAMPLES`` or longer than
            ``max_samples``; rows of another width than ``width``.
    """
    audio = message.get("audio")
    if audio is None:
        return None
    if cfg is None:
        raise ValueError("this model has no audio encoder; send text only")
    if message.get("role", "user") != "user":
        raise ValueError("only user messages may carry audio")
    rate = message.get("audio_rate", SAMPLE_RATE)
    if rate != SAMPLE_RATE:
        raise ValueError(
            f"audio must be at {SAMPLE_RATE} Hz, got {rate} Hz; resample it first "
            "(mstar_async.realtime.resample.PcmResampler streams pcm16 to 16 kHz)"
        )
    if isinstance(audio, torch.Tensor) and audio.dim() == 2:
        if audio.shape[1] != width or audio.shape[0] == 0:
            raise ValueError(
                f"encoded audio must be rows [n > 0, {width}] from this model's encoder, got "
                f"{tuple(audio.shape)}"
            )
        return audio
    pcm = pcm_piece(audio)
    check_length(pcm.numel(), max_samples, final=True)
    return pcm


def check_length(samples: int, max_samples: int, *, final: bool) -> None:
    """Raises ValueError when ``samples`` passes ``max_samples``, or (``final``: the
    utterance is whole) is below ``MIN_SAMPLES``; the message names the limit and the fix."""
    if samples > max_samples:
        raise ValueError(
            f"an utterance may hold at most {max_samples / SAMPLE_RATE:g} s of audio, this one "
            f"has {samples / SAMPLE_RATE:g} s or more; cut it into turns or build the model "
            "with a larger max_audio_seconds"
        )
    if final and samples < MIN_SAMPLES:
        raise ValueError(
            f"an utterance needs at least {MIN_SAMPLES} samples "
            f"({MIN_SAMPLES * 1000 / SAMPLE_RATE:.1f} ms at 16 kHz), got {samples}"
        )


def audio_rows(cfg: AudioEncoderConfig, audio: torch.Tensor) -> int:
    """Placeholders an audio part takes: its rows, or the encoder's output length for PCM."""
    if audio.dim() == 2:
        return int(audio.shape[0])
    return cfg.output_length(audio.numel() // HOP)


@dataclass(frozen=True)
class Prompt:
    """The thinker's prompt ids and where each audio part's ``audio_pad`` run starts."""

    ids: list[int]
    audio_at: list[int]  # the offset of each audio part's first pad, in message order


def build_prompt(
    tokenizer: ChatTokenizer,
    tokens: AudioTokens | None,
    messages: Sequence[Mapping[str, Any]],
    counts: Sequence[int],
) -> Prompt:
    """Render ``messages`` with the chat template; the ``k``-th message holding ``"audio"``
    gets ``counts[k]`` pads before its text. Pure but for the tokenizer.

    Raises:
        ValueError: text holding the private character that marks an audio part; audio
            without ``tokens``; the template cannot render the messages.
    """
    rendered: list[Mapping[str, Any]] = []
    for message in messages:
        text = message.get("content")
        if isinstance(text, str) and _SLOT in text:
            raise ValueError("a message's text holds U+F0000, which marks audio here")
        if "audio" not in message:
            rendered.append(message)  # as given: the template judges it
            continue
        if message["audio"] is not None and tokens is None:
            raise ValueError("this model has no audio encoder; send text only")
        if text is not None and not isinstance(text, str):
            raise ValueError("a message's content must be a string")
        slot = _SLOT if message["audio"] is not None else ""
        rendered.append(
            {**{k: v for k, v in message.items() if k != "audio"}, "content": slot + (text or "")}
        )
    pieces = tokenizer.apply_chat_template(rendered).split(_SLOT)
    ids = tokenizer.encode(pieces[0])
    audio_at: list[int] = []
    for count, piece in zip(counts, pieces[1:], strict=True):
        assert tokens is not None
        ids.append(tokens.start)
        audio_at.append(len(ids))
        ids += [tokens.pad] * count
        ids.append(tokens.end)
        ids += tokenizer.encode(piece)
    return Prompt(ids, audio_at)
