"""The image encoder of the editing walk: a SigLIP-style ViT and BAGEL's connector.

Patch embedding (a strided convolution) plus learned positions, pre-norm transformer layers
with bidirectional attention and tanh-GELU MLPs, a final layer norm; then the connector (a
two-layer GELU MLP) into the backbone's width and fixed 2-D positions (``vit_pos_embed``).
Submodule names follow SigLIP's ``vision_model`` and BAGEL's ``connector``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.bagel.config import BagelConfig
from mstar_async.models.bagel.mot import sincos_2d


class _Embeddings(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.vit_hidden, cfg.vit_patch, stride=cfg.vit_patch)
        self.position_embedding = nn.Embedding(cfg.vit_grid**2, cfg.vit_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        out: torch.Tensor = x + self.position_embedding.weight
        return out


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.heads = cfg.vit_heads
        d = cfg.vit_hidden
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(b, n, d))
        return projected


class _MLP(nn.Module):
    def __init__(self, width: int, inner: int, out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, inner)
        self.fc2 = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return out


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.vit_hidden, eps=1e-6)
        self.self_attn = _SelfAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.vit_hidden, eps=1e-6)
        self.mlp = _MLP(cfg.vit_hidden, cfg.vit_intermediate, cfg.vit_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class _Encoder(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.vit_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _VisionModel(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.vit_hidden, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post_layernorm(self.encoder(self.embeddings(pixels)))
        return out


class ImageEncoder(nn.Module):
    """RGB images ``[batch, 3, S, S]`` in [0, 1] -> backbone-width tokens ``[batch, patches,
    hidden]``, one per ViT patch, row-major."""

    def __init__(self, cfg: BagelConfig) -> None:
        """Build with weights seeded from ``cfg.seed``, without touching the global RNG."""
        super().__init__()
        self.size = cfg.vit_image_size
        self.vit_pos_embed: torch.Tensor
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed + 3)
            self.vision_model = _VisionModel(cfg)
            self.connector = _MLP(cfg.vit_hidden, cfg.hidden, cfg.hidden)
        self.register_buffer("vit_pos_embed", sincos_2d(cfg.hidden, cfg.vit_grid), persistent=False)
        self.eval()

    def forward(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a batch of images; returns ``{"embeds": [batch, patches, hidden]}``.

        Raises:
            ValueError: the images are not ``[batch, 3, S, S]`` at the configured size.
        """
        want = (3, self.size, self.size)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != want:
            raise ValueError(f"images must be [batch, {want}], got {tuple(pixels.shape)}")
        x = self.vision_model((pixels - 0.5) / 0.5)
        return {"embeds": self.connector(x) + self.vit_pos_embed}
