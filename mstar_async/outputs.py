"""The typed outputs a request program yields: what clients of the runtime receive."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of generated text, in order; ``segment`` numbers the speech segment it voices."""

    text: str
    segment: int = 0


@dataclass(frozen=True, slots=True)
class TextEnd:
    """The last output of a text generation: token counts and why it stopped.

    ``finish_reason`` is ``"stop"`` (a stop token or stop string) or ``"length"`` (the
    request's ``max_tokens``). ``completion_tokens`` counts sampled tokens, the stop token
    excluded.
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """Mono PCM samples in [-1, 1] (float32), with their sample rate and speech segment."""

    pcm: torch.Tensor
    sample_rate: int
    segment: int = 0

    @property
    def seconds(self) -> float:
        """Duration of this chunk."""
        return self.pcm.numel() / self.sample_rate


@dataclass(frozen=True, slots=True)
class EncodedAudio:
    """Speech heard so far: the encoder ``rows`` this piece completed (``[n, hidden]``, often
    ``n`` = 0; joined in order they are the utterance's encoding), ``frames`` (feature frames
    of the utterance through the encoder's convolutions so far) and ``samples`` (samples
    received so far)."""

    rows: torch.Tensor
    frames: int
    samples: int


@dataclass(frozen=True, slots=True)
class ImageOutput:
    """An image as a float tensor [channels, height, width] with values in [0, 1]."""

    image: torch.Tensor


@dataclass(frozen=True, slots=True)
class LatentOutput:
    """A latent tensor (world-model predictions, intermediate states)."""

    latent: torch.Tensor
    step: int = 0


@dataclass(frozen=True, slots=True)
class ActionOutput:
    """A chunk of robot actions [horizon, action_dim]."""

    actions: torch.Tensor
