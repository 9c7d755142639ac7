"""Sizes of the BAGEL-style model, and the byte-level tokenizer its prompts go through."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mstar_async.models.llama import DecoderConfig

#: Byte ids 0..255, then the special tokens.
BOS_ID = 256
VOCAB_SIZE = 258


@dataclass(frozen=True)
class BagelConfig:
    """Shape of the language backbone (both experts), the ViT, the latent grid and the decoder.

    The backbone is Qwen2-shaped (BAGEL starts from Qwen2.5); the generation expert has the same
    shape as the understanding expert (BAGEL's mixture-of-transformers). An image of
    ``image_size`` pixels is a latent grid ``image_size / downsample`` wide with
    ``latent_channels`` channels, cut into ``latent_patch`` x ``latent_patch`` patches: one token
    each (BAGEL: 16 channels, downsample 8, patch 2).
    """

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    image_size: int = 64
    downsample: int = 8
    latent_channels: int = 4
    latent_patch: int = 2
    decoder_channels: int = 32
    vit_image_size: int = 64
    vit_patch: int = 16
    vit_hidden: int = 48
    vit_layers: int = 1
    vit_heads: int = 4
    vit_intermediate: int = 96
    timestep_shift: float = 3.0
    vae_scale: float = 0.3611
    vae_shift: float = 0.1159
    seed: int = 0

    def __post_init__(self) -> None:
        """Check that the grids divide evenly.

        Raises:
            ValueError: ``image_size`` is not a multiple of ``downsample * latent_patch``, or
                ``vit_image_size`` not a multiple of ``vit_patch``.
        """
        if self.image_size % (self.downsample * self.latent_patch):
            raise ValueError(
                f"image_size {self.image_size} must be a multiple of downsample * latent_patch "
                f"({self.downsample * self.latent_patch})"
            )
        if self.vit_image_size % self.vit_patch:
            raise ValueError(
                f"vit_image_size {self.vit_image_size} must be a multiple of vit_patch "
                f"({self.vit_patch})"
            )

    @property
    def latent_size(self) -> int:
        """Latent grid width (and height)."""
        return self.image_size // self.downsample

    @property
    def grid(self) -> int:
        """Image tokens per side."""
        return self.latent_size // self.latent_patch

    @property
    def image_tokens(self) -> int:
        """Latent tokens of one generated image."""
        return self.grid**2

    @property
    def token_dim(self) -> int:
        """Width of one latent token: a patch of every latent channel."""
        return self.latent_channels * self.latent_patch**2

    @property
    def vit_grid(self) -> int:
        """ViT patches per side of an input image."""
        return self.vit_image_size // self.vit_patch

    def decoder(self) -> DecoderConfig:
        """The backbone's ``DecoderConfig`` (Qwen2: q/k/v biases, untied head)."""
        return DecoderConfig(
            model_type="qwen2",
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            qkv_bias=True,
            max_position_embeddings=32768,
            bos_token_id=BOS_ID,
        )


SIZES: dict[str, BagelConfig] = {
    "tiny": BagelConfig(),
    "small": BagelConfig(
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=4,
        intermediate=768,
        image_size=128,
        latent_channels=4,
        decoder_channels=48,
        vit_image_size=128,
        vit_hidden=192,
        vit_layers=2,
        vit_heads=6,
        vit_intermediate=512,
    ),
}


def bagel_config(size: str = "tiny", **overrides: Any) -> BagelConfig:
    """The config of a named size with ``overrides`` applied.

    Raises:
        ValueError: an unknown size (the message lists them).
        TypeError: an override names no field.
    """
    if size not in SIZES:
        raise ValueError(f"unknown bagel size {size!r}; sizes: {sorted(SIZES)}")
    return replace(SIZES[size], **overrides)


def tokenize(text: str) -> torch.Tensor:
    """The prompt as UTF-8 bytes after a begin-of-sequence id.

    Why bytes: the weights are seeded, so no learned vocabulary gives the ids meaning, and a byte
    vocabulary keeps the model self-contained (no tokenizer files, nothing to convert); prompt
    lengths in tokens are then the byte count plus one.
    """
    return torch.tensor([BOS_ID, *text.encode()], dtype=torch.long)
