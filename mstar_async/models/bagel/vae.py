"""The latent-to-pixels decoder: a small convolutional VAE decoder (FLUX/SD autoencoder layout).

Latent tokens are unpatchified into a ``[channels, h, w]`` grid, un-scaled (the autoencoder's
scale and shift), then ``conv_in``, one residual block per resolution with a nearest-neighbour
2x upsample between them (``log2(downsample)`` times), group norm, SiLU and ``conv_out`` to RGB,
mapped from [-1, 1] to [0, 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.bagel.config import BagelConfig


def unpatchify(tokens: torch.Tensor, cfg: BagelConfig) -> torch.Tensor:
    """``[batch, grid * grid, channels * p * p]`` tokens -> ``[batch, channels, size, size]``."""
    b, p, g, c = tokens.shape[0], cfg.latent_patch, cfg.grid, cfg.latent_channels
    x = tokens.reshape(b, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, g * p, g * p)


def patchify(latent: torch.Tensor, cfg: BagelConfig) -> torch.Tensor:
    """The inverse of :func:`unpatchify`."""
    b, p, g, c = latent.shape[0], cfg.latent_patch, cfg.grid, cfg.latent_channels
    x = latent.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, g * g, c * p * p)


class _ResnetBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        out: torch.Tensor = x + self.conv2(F.silu(self.norm2(h)))
        return out


class _Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return out


class _UpLevel(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block = _ResnetBlock(channels)
        self.upsample = _Upsample(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.upsample(self.block(x))
        return out


class _Decoder(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        ch = cfg.decoder_channels
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch, 3, padding=1)
        self.mid = _ResnetBlock(ch)
        levels = round(math.log2(cfg.downsample))
        self.up = nn.ModuleList(_UpLevel(ch) for _ in range(levels))
        self.norm_out = nn.GroupNorm(8, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.conv_in(z))
        for level in self.up:
            x = level(x)
        out: torch.Tensor = self.conv_out(F.silu(self.norm_out(x)))
        return out


class ImageDecoder(nn.Module):
    """Latent tokens ``[batch, tokens, token_dim]`` -> RGB ``[batch, 3, size, size]`` in [0, 1]."""

    def __init__(self, cfg: BagelConfig) -> None:
        """Build with weights seeded from ``cfg.seed``, without touching the global RNG.

        Raises:
            ValueError: ``cfg.downsample`` is not a power of two.
        """
        super().__init__()
        if cfg.downsample & (cfg.downsample - 1):
            raise ValueError(f"downsample must be a power of two, got {cfg.downsample}")
        self.cfg = cfg
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed + 4)
            self.decoder = _Decoder(cfg)
        self.eval()

    def forward(self, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        """Decode a batch of latents; returns ``{"image": [batch, 3, size, size]}``."""
        z = unpatchify(latent, self.cfg) / self.cfg.vae_scale + self.cfg.vae_shift
        rgb = self.decoder(z.to(self.decoder.conv_in.weight.dtype))
        return {"image": ((rgb.clamp(-1, 1) + 1) / 2).float()}
