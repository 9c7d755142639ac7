"""The request program's speech-in part: running the audio encoder's walks and gathering the
rows the thinker's prefill takes.

Two walks run the ``audio_in`` node, differing only in how their streamed input is cut:

- ``listen`` (``LISTEN_CHUNK`` samples, 100 ms): speech that streams in while the user talks.
  The node fires every 100 ms of speech; a 1 s chunk of features is convolved as soon as its
  last 100 ms is in, and an attention window (8 s) as soon as its last chunk is, so when the
  user stops, one partial chunk and at most one window are left.
- ``hear`` (``HEAR_CHUNK`` samples, 8 s): speech given whole; fewer, larger steps.

Each step yields ``EncodedAudio`` (the rows it completed and the frames convolved so far).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import torch

from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoderConfig
from mstar_async.models.qwen3_omni.audio_prompt import check_length, pcm_piece
from mstar_async.outputs import EncodedAudio

__all__ = ["HEAR_CHUNK", "LISTEN_CHUNK", "encode_audio", "encoded_rows", "pieces_of"]

#: Samples per ``listen`` step: 100 ms at 16 kHz.
LISTEN_CHUNK = 1_600
#: Samples per ``hear`` step: 8 s at 16 kHz, one attention window of the released encoder.
HEAR_CHUNK = 128_000
#: ``listen`` chunks a stream may run ahead of the encoder before its feeder waits (6.4 s).
LISTEN_BUFFER = 64


async def _checked(
    pieces: AsyncIterable[Any], max_samples: int, counted: list[int]
) -> AsyncGenerator[torch.Tensor, None]:
    """The pieces as float32 samples, each checked (shape, type, the utterance's length so
    far) before it is fed, so a bad or overlong stream fails before its encoder work. The
    walk's feeder iterates and closes this generator; it closes ``pieces`` in turn."""
    items = aiter(pieces)
    try:
        async for piece in items:
            samples = pcm_piece(piece)
            counted[0] += samples.numel()
            check_length(counted[0], max_samples, final=False)
            if samples.numel():
                yield samples
    finally:
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()
    check_length(counted[0], max_samples, final=True)


async def pieces_of(pcm: torch.Tensor) -> AsyncGenerator[torch.Tensor, None]:
    """Whole PCM as a stream of one piece (the walk's policy cuts it)."""
    yield pcm


async def encode_audio(
    request: Any, pieces: AsyncIterable[Any], max_samples: int, *, walk: str = "listen"
) -> AsyncGenerator[EncodedAudio, None]:
    """Run ``walk`` over one utterance's 16 kHz ``pieces``; yield what each step made.

    Cancel-safe: closing the generator stops the walk (the engine forgets the utterance when
    the request is released).

    Raises:
        ValueError: a piece that is not mono float/int16 PCM; the utterance passes
            ``max_samples`` or ends under ``MIN_SAMPLES``.
        RequestError: the encoder's step failed.
    """
    counted = [0]
    rows: list[torch.Tensor] = []
    frames = 0
    # The walk's feeder owns the checked stream: it iterates it and closes it when the walk
    # ends or is cancelled (closing it here could race the feeder still inside it).
    async with request.stream(walk, pcm=_checked(pieces, max_samples, counted)) as events:
        async for event in events:
            if event.port == "audio_in.rows":
                if event.value.numel():
                    rows.append(event.value)
                continue
            new = torch.cat(rows) if rows else torch.zeros(0)
            rows, frames = [], int(event.value)
            yield EncodedAudio(new, frames, counted[0])
    if rows:  # a rows event that came after its step's frames
        yield EncodedAudio(torch.cat(rows), frames, counted[0])


async def encoded_rows(
    request: Any,
    audio: torch.Tensor,
    cfg: AudioEncoderConfig,
    max_samples: int,
) -> torch.Tensor:
    """The encoder's rows for one message's audio: rows given as they are, PCM through the
    ``hear`` walk. Cancel-safe (the walk is stopped).

    Raises:
        RuntimeError: the encoder made another number of rows than its output length (a bug).
        ValueError, RequestError: as ``encode_audio``.
    """
    if audio.dim() == 2:
        return audio
    heard = encode_audio(request, pieces_of(audio), max_samples, walk="hear")
    async with aclosing(heard) as pieces:
        parts = [piece.rows async for piece in pieces]
    rows = torch.cat([p for p in parts if p.numel()])
    want = cfg.output_length(audio.numel() // 160)
    if rows.shape[0] != want:
        raise RuntimeError(f"the audio encoder made {rows.shape[0]} rows, expected {want}")
    return rows


def with_turn(
    text: str, messages: Sequence[Mapping[str, Any]] | None, audio: torch.Tensor | None
) -> list[dict[str, Any]]:
    """The conversation: ``messages`` (or one user turn of ``text``), and, when ``audio`` is
    given, a last user turn holding it (with ``text`` when there are no messages)."""
    conversation = [dict(m) for m in messages] if messages else []
    if audio is None:
        return conversation or [{"role": "user", "content": text}]
    if conversation:
        return [*conversation, {"role": "user", "content": "", "audio": audio}]
    return [{"role": "user", "content": text, "audio": audio}]
