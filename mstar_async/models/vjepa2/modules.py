"""V-JEPA 2 networks: the ViT encoder and the action-conditioned (AC) predictor.

Module and parameter names follow upstream (``patch_embed.proj``, ``blocks.N.attn.qkv``,
``predictor_blocks.N.mlp.fc1``, ``action_encoder``, ...) so their state dicts load by name.
Attention is a seam: a block computes q, k, v and rotates them, and a callable given by the
caller attends. The encoder attends densely within a frame; the predictor attends either
densely under a block-causal mask (the reference rollout) or through a KV cache (the engine).

Positions are 3-D rotary embeddings, as upstream: a head's first three slices of
``2 * (head_dim // 3 // 2)`` dims rotate by frame, row and column; the rest is not rotated.
Action and state tokens rotate by frame only (their row and column angles are zero).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.vjepa2.config import VJEPA2Config

#: ``attend(q, k, v) -> out`` on ``[..., tokens, heads, head_dim]`` tensors (k, v of this call
#: only; a cached attention adds what it holds).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: ``attend(layer, q, k, v) -> out``: the predictor's seam, told which layer calls it.
LayerAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_tables(
    head_dim: int, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines ``[tokens, 1, head_dim]`` of the 3-D rotary embedding.

    Each of the three rotated slices of ``d`` dims uses frequencies ``10000 ** (-i / (d/2))``
    for ``i < d/2``, laid out twice in a row across the slice (upstream's layout, which its
    checkpoints were trained with); the unrotated tail gets cosine 1 and sine 0.
    """
    d = 2 * ((head_dim // 3) // 2)
    omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
    parts = []
    for pos in (frame, row, col):
        freq = pos.to(torch.float64).unsqueeze(-1) * omega
        parts.append(torch.cat([freq, freq], dim=-1))
    angles = torch.cat(parts, dim=-1)
    tail = head_dim - 3 * d
    cos = torch.cat([angles.cos(), angles.new_ones(angles.shape[0], tail)], dim=-1)
    sin = torch.cat([angles.sin(), angles.new_zeros(angles.shape[0], tail)], dim=-1)
    return cos.unsqueeze(1).float(), sin.unsqueeze(1).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``."""
    pairs = x.view(*x.shape[:-1], -1, 2)
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention with rotary q/k; the attending itself is the caller's."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        qkv: torch.Tensor = self.qkv(x)
        q, k, v = qkv.view(*x.shape[:-1], 3, self.num_heads, -1).unbind(-3)
        out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        projected: torch.Tensor = self.proj(out.flatten(-2))
        return projected


class MLP(nn.Module):
    """Two linear layers with a GELU between them."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class Block(nn.Module):
    """A pre-norm transformer block (upstream ``Block`` / ``ACBlock`` without drop-path)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def dense_attend(mask: torch.Tensor | None = None) -> Attend:
    """Attention over this call's own keys, under an optional boolean ``[q, k]`` mask."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask
        )
        return out.transpose(-3, -2)

    return attend


def _init_weights(module: nn.Module, depth_blocks: nn.ModuleList) -> None:
    # Upstream's initialisation: truncated normal (std 0.02) linears, zero biases, and output
    # projections of block i scaled by 1/sqrt(2 i), so seeded random weights keep activations
    # at a realistic scale through depth.
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    with torch.no_grad():
        for i, block in enumerate(depth_blocks, start=1):
            assert isinstance(block, Block)
            block.attn.proj.weight.div_((2.0 * i) ** 0.5)
            block.mlp.fc2.weight.div_((2.0 * i) ** 0.5)


class PatchEmbed3D(nn.Module):
    """Tubelets of ``tubelet_size`` frames by ``patch_size`` squared pixels to tokens."""

    def __init__(self, cfg: VJEPA2Config) -> None:
        super().__init__()
        size = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.encoder_dim, kernel_size=size, stride=size)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """``[n, channels, time, height, width]`` -> ``[n, tokens, dim]``."""
        tokens: torch.Tensor = self.proj(video)
        return tokens.flatten(2).transpose(1, 2)


class VisionEncoder(nn.Module):
    """The V-JEPA 2 ViT, used as upstream's AC model uses it: each frame on its own, repeated
    to fill one tubelet, gives ``grid ** 2`` tokens; the output is layer-normalised without
    affine parameters (upstream's ``normalize_reps``)."""

    def __init__(self, cfg: VJEPA2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed3D(cfg)
        self.blocks = nn.ModuleList(
            Block(cfg.encoder_dim, cfg.encoder_heads, cfg.encoder_mlp_ratio)
            for _ in range(cfg.encoder_depth)
        )
        self.norm = nn.LayerNorm(cfg.encoder_dim, eps=1e-6)
        _init_weights(self, self.blocks)
        rows = torch.arange(cfg.patches_per_frame) // cfg.grid
        cols = torch.arange(cfg.patches_per_frame) % cfg.grid
        cos, sin = rope_tables(
            cfg.encoder_dim // cfg.encoder_heads, torch.zeros_like(rows), rows, cols
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Encode ``[n, channels, height, width]`` frames to ``[n, grid**2, encoder_dim]``.

        Raises:
            ValueError: the frames are not ``[n, in_chans, image_size, image_size]``.
        """
        cfg = self.cfg
        want = (cfg.in_chans, cfg.image_size, cfg.image_size)
        if frames.dim() != 4 or tuple(frames.shape[1:]) != want:
            raise ValueError(
                f"frames must be [n, {', '.join(map(str, want))}], got {tuple(frames.shape)}"
            )
        tubelets = frames.unsqueeze(2).expand(-1, -1, cfg.tubelet_size, -1, -1)
        x = self.patch_embed(tubelets)
        attend = dense_attend()
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin, attend)
        x = self.norm(x)
        return F.layer_norm(x, (x.shape[-1],))


class ACPredictor(nn.Module):
    """The action-conditioned predictor (upstream ``VisionTransformerPredictorAC``).

    A frame becomes ``[action, state, patch_1 .. patch_n]`` tokens; attention is block-causal
    over frames (a token sees every token of its own frame and of earlier frames), and the
    output at frame ``t``'s patches predicts frame ``t + 1``'s latent.
    """

    def __init__(self, cfg: VJEPA2Config) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.predictor_dim
        self.predictor_embed = nn.Linear(cfg.encoder_dim, dim)
        self.action_encoder = nn.Linear(cfg.action_dim, dim)
        self.state_encoder = nn.Linear(cfg.action_dim, dim)
        self.predictor_blocks = nn.ModuleList(
            Block(dim, cfg.predictor_heads, cfg.mlp_ratio) for _ in range(cfg.predictor_depth)
        )
        self.predictor_norm = nn.LayerNorm(dim, eps=1e-6)
        self.predictor_proj = nn.Linear(dim, cfg.encoder_dim)
        _init_weights(self, self.predictor_blocks)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head."""
        return self.cfg.predictor_dim // self.cfg.predictor_heads

    def tokens(
        self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor
    ) -> torch.Tensor:
        """Interleave ``[n, patches, encoder_dim]`` latents with their ``[n, action_dim]``
        actions and states: ``[n * tokens_per_frame, predictor_dim]``, frame by frame."""
        x = self.predictor_embed(latents)
        a = self.action_encoder(actions).unsqueeze(1)
        s = self.state_encoder(states).unsqueeze(1)
        return torch.cat([a, s, x], dim=1).flatten(0, 1)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for tokens at absolute ``positions`` of a request's token sequence."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if self._rope is None or self._rope[0].shape[0] < needed:
            # Why a table kept across calls: a rollout step needs one frame's rows, and
            # computing sines afresh for every forward costs as much as a small layer.
            self._rope = self._rope_rows(
                max(needed, 2 * (0 if self._rope is None else self._rope[0].shape[0]))
            )
        cos, sin = self._rope
        return cos[positions], sin[positions]

    def _rope_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        n = -(-n // cfg.tokens_per_frame) * cfg.tokens_per_frame
        positions = torch.arange(n)
        frame = positions // cfg.tokens_per_frame
        patch = positions % cfg.tokens_per_frame - cfg.cond_tokens
        is_patch = patch >= 0
        row = torch.where(is_patch, patch // cfg.grid, 0)
        col = torch.where(is_patch, patch % cfg.grid, 0)
        device = self.predictor_embed.weight.device
        cos, sin = rope_tables(self.head_dim, frame, row, col)
        return cos.to(device), sin.to(device)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attend: LayerAttend
    ) -> torch.Tensor:
        """Run the blocks over tokens ``x`` ``[tokens, dim]`` at ``positions`` ``[tokens]``;
        ``attend(layer, q, k, v)`` supplies each layer's attention."""
        cos, sin = self.rope(positions)
        for layer, block in enumerate(self.predictor_blocks):

            def layer_attend(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = layer
            ) -> torch.Tensor:
                return attend(layer, q, k, v)

            x = block(x, cos, sin, layer_attend)
        return x

    def head(self, patches: torch.Tensor) -> torch.Tensor:
        """Predicted latents from the output at patch tokens: norm, project, normalise."""
        out = self.predictor_proj(self.predictor_norm(patches))
        return F.layer_norm(out, (out.shape[-1],))

    def predict_all(
        self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor
    ) -> torch.Tensor:
        """The whole-context forward: ``[T, patches, dim]`` latents with ``[T, action_dim]``
        actions and states -> ``[T, patches, dim]``, row ``t`` predicting frame ``t + 1``."""
        cfg = self.cfg
        x = self.tokens(latents, actions, states)
        positions = torch.arange(x.shape[0], device=x.device)
        frame = positions // cfg.tokens_per_frame
        mask = frame.unsqueeze(1) >= frame.unsqueeze(0)  # block-causal: own and earlier frames
        dense = dense_attend(mask)
        hidden = self.forward(x, positions, lambda _layer, q, k, v: dense(q, k, v))
        frames = hidden.view(latents.shape[0], cfg.tokens_per_frame, -1)
        return self.head(frames[:, cfg.cond_tokens :])
