"""A cloned voice as the model uses it: computed once from reference audio, reused per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VoicePrompt"]


@dataclass(frozen=True)
class VoicePrompt:
    """What a request needs to speak in a cloned voice.

    Attributes:
        speaker: the speaker encoder's embedding ``[talker hidden]`` (float32).
        codes: the reference audio's codec frames ``[frames, G]`` (long) for in-context
            cloning, or ``None`` (the embedding alone: upstream's x-vector-only mode).
        transcript: what the reference audio says; required with ``codes``.
        id: a registered voice's id (the voice registry's; never reused for another voice):
            the KV of the prompt rows every request of the voice shares is kept per talker
            rank under it. None (a voice cloned for one request): nothing is kept.
    """

    speaker: torch.Tensor
    codes: torch.Tensor | None = None
    transcript: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        """Raises ValueError: codes without a transcript, or tensors of the wrong rank."""
        if self.speaker.dim() != 1:
            raise ValueError(f"speaker embedding must be 1-D, got {tuple(self.speaker.shape)}")
        if self.codes is not None:
            if self.codes.dim() != 2:
                raise ValueError(f"codes must be [frames, G], got {tuple(self.codes.shape)}")
            if not self.transcript:
                raise ValueError("in-context cloning needs the reference audio's transcript")

    @property
    def in_context(self) -> bool:
        """Whether the reference codes are part of the prompt (else the embedding alone)."""
        return self.codes is not None
