"""Gemma-like transformer layers of the pi0.5-style policy: the prefix LM and the action expert.

Parameter names follow Hugging Face's Gemma (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``) and openpi's PyTorch port for the expert's extras (``action_in_proj``,
``time_mlp_in``, ``action_out_proj``). The prefix LM keeps, per layer, the keys and values of
its tokens; the expert's queries attend to those and to its own action tokens (upstream runs
both stacks as one joint attention per layer; with the prefix cached that is the same sum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.pi05.config import GemmaConfig, Pi05Config


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Divide ``x`` by its root mean square over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the learned scale is ``1 + weight``."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        return rms(x, self.eps) * (1 + self.weight), None


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: the time condition sets a scale, a shift and a residual gate."""

    def __init__(self, width: int, cond_width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = nn.Linear(cond_width, 3 * width)

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert cond is not None, "an adaptive norm needs its condition"
        scale, shift, gate = self.modulation(cond).unsqueeze(-2).chunk(3, dim=-1)
        return rms(x, self.eps) * (1 + scale) + shift, gate


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [batch, heads, tokens, head_dim] at ``positions`` [batch, tokens]
    (the two halves of each head rotate together, as in Hugging Face's Gemma)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Query, key, value and output projections (multi-query when ``num_kv_heads`` is 1)."""

    def __init__(self, cfg: GemmaConfig, theta: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.theta = theta
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, and values, each [batch, heads, tokens, head_dim]."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """Merge heads [batch, heads, tokens, head_dim] and project back to the width."""
        b, _, t, _ = attended.shape
        out: torch.Tensor = self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention; ``mask`` is boolean (true: may attend), broadcastable to
    [batch, heads, queries, keys]. Key/value heads are shared by groups of query heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    """Gemma's gated MLP with the tanh-approximated GELU."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.mlp_dim, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(
            F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)
        )
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with ``cond_width`` the norms are adaptive and gate the
    residuals (the action expert of pi0.5)."""

    def __init__(self, cfg: GemmaConfig, theta: float, eps: float, cond_width: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, theta)
        self.mlp = MLP(cfg)
        if cond_width is None:
            self.input_layernorm: nn.Module = RMSNorm(cfg.width, eps)
            self.post_attention_layernorm: nn.Module = RMSNorm(cfg.width, eps)
        else:
            self.input_layernorm = AdaRMSNorm(cfg.width, cond_width, eps)
            self.post_attention_layernorm = AdaRMSNorm(cfg.width, cond_width, eps)

    def add_attention(
        self, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        """The residual after attention (gated when adaptive)."""
        out = self.self_attn.output(attended)
        return x + (out if gate is None else out * gate)

    def add_mlp(self, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
        """The MLP half of the layer, with its residual."""
        normed, gate = self.post_attention_layernorm(x, cond)
        out: torch.Tensor = self.mlp(normed)
        return x + (out if gate is None else out * gate)


def _init_norms(module: nn.Module) -> None:
    # Upstream initialises these scales at zero (an identity norm); seeded small values make
    # every weight matter, so a wrong parameter shows up in the tests.
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            nn.init.normal_(sub.weight, std=0.1)


#: One (keys, values) pair per layer, each [batch, kv_heads, tokens, head_dim].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class PrefixLM(nn.Module):
    """The VLM's language model over the prefix (image tokens, then instruction and state).

    The prefix attends bidirectionally within itself (a prefix-LM, as upstream). Only its keys
    and values matter to the actions, so the last layer stops after its key/value projection.
    """

    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        lm = cfg.lm
        self.width = lm.width
        self.embed_tokens = nn.Embedding(cfg.vocab, lm.width)
        nn.init.normal_(self.embed_tokens.weight, std=lm.width**-0.5)
        self.layers = nn.ModuleList(
            DecoderLayer(lm, cfg.rope_theta, cfg.norm_eps, None) for _ in range(lm.depth)
        )
        _init_norms(self)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled by sqrt(width), as Gemma does for text."""
        out: torch.Tensor = self.embed_tokens(tokens) * math.sqrt(self.width)
        return out

    def layer_kv(self, embeds: torch.Tensor, lengths: torch.Tensor) -> LayerKV:
        """Keys and values of every layer for right-padded prefixes [batch, tokens, width] whose
        true lengths are ``lengths``; padding is masked out of every attention."""
        b, t, _ = embeds.shape
        positions = torch.arange(t, device=embeds.device).expand(b, t)
        mask = (positions < lengths.unsqueeze(1)).view(b, 1, 1, t)
        h = embeds
        out: LayerKV = []
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            normed, _ = layer.input_layernorm(h)
            q, k, v = layer.self_attn.project(normed, positions)
            out.append((k, v))
            if i == len(self.layers) - 1:
                break
            h = layer.add_attention(h, attend(q, k, v, mask), None)
            h = layer.add_mlp(h, None)
        return out


def time_embedding(time: torch.Tensor, width: int) -> torch.Tensor:
    """Sine-cosine embedding of flow-matching times in [0, 1] (periods 4e-3 to 4, as upstream)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float32, device=time.device)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = time.to(torch.float32).unsqueeze(-1) * (2 * math.pi / period)
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class ActionExpert(nn.Module):
    """The flow-matching action expert: noisy actions and a time -> a velocity for each action.

    Its layers' queries attend to the prefix's cached keys and values of the same layer and,
    bidirectionally, to the action tokens; the time conditions every norm (adaRMS).
    """

    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        ex = cfg.expert
        self.cfg = cfg
        self.action_in_proj = nn.Linear(cfg.action_dim, ex.width)
        self.time_mlp_in = nn.Linear(ex.width, ex.width)
        self.time_mlp_out = nn.Linear(ex.width, ex.width)
        self.layers = nn.ModuleList(
            DecoderLayer(ex, cfg.rope_theta, cfg.norm_eps, ex.width) for _ in range(ex.depth)
        )
        self.norm = AdaRMSNorm(ex.width, ex.width, cfg.norm_eps)
        self.action_out_proj = nn.Linear(ex.width, cfg.action_dim)

    def condition(self, time: torch.Tensor) -> torch.Tensor:
        """The adaRMS condition [batch, width] from times [batch]."""
        emb = time_embedding(time, self.cfg.expert.width).to(self.action_in_proj.weight.dtype)
        out: torch.Tensor = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))
        return out

    def velocity(
        self,
        actions: torch.Tensor,
        time: torch.Tensor,
        prefix: LayerKV,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Velocities [batch, horizon, action_dim] of noisy ``actions`` at ``time`` [batch].

        ``prefix`` holds each layer's right-padded prefix keys and values [batch, kv_heads,
        longest, dim]; ``lengths`` [batch] the true prefix lengths. Action tokens sit at the
        positions right after their own prefix.
        """
        b, horizon, _ = actions.shape
        longest = prefix[0][0].shape[2]
        x = self.action_in_proj(actions)
        cond = self.condition(time)
        steps = torch.arange(horizon, device=x.device)
        positions = lengths.unsqueeze(1) + steps
        keys = torch.arange(longest, device=x.device)
        valid = torch.cat(
            [
                keys < lengths.unsqueeze(1),
                torch.ones(b, horizon, dtype=torch.bool, device=x.device),
            ],
            dim=1,
        )
        mask = valid.view(b, 1, 1, longest + horizon)
        for layer, (pk, pv) in zip(self.layers, prefix, strict=True):
            assert isinstance(layer, DecoderLayer)
            normed, gate = layer.input_layernorm(x, cond)
            q, k, v = layer.self_attn.project(normed, positions)
            attended = attend(q, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), mask)
            x = layer.add_attention(x, attended, gate)
            x = layer.add_mlp(x, cond)
        normed, _ = self.norm(x, cond)
        out: torch.Tensor = self.action_out_proj(normed)
        return out


class Pi05Policy(nn.Module):
    """The prefix LM and the action expert, with seeded weights."""

    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.lm = PrefixLM(cfg)
        self.expert = ActionExpert(cfg)

    def prefix_embeds(self, image_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One request's prefix [image tokens + text tokens, width]."""
        return torch.cat(
            [image_tokens.to(self.lm.embed_tokens.weight.dtype), self.lm.embed(tokens)]
        )


def right_pad(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [length_i, ...] tensors right-padded with zeros; also return the lengths."""
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=rows[0].device)
    out = rows[0].new_zeros((len(rows), int(lengths.max()), *rows[0].shape[1:]))
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out, lengths
