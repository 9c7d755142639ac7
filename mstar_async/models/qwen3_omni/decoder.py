"""A Qwen3-family decoder stack (thinker, talker, code predictor) over a flat, unpadded batch.

What Qwen3 adds to the Llama layer of :mod:`mstar_async.models.llama`: an RMSNorm over each
head of ``q`` and ``k`` before the rotary embedding (``q_norm`` / ``k_norm``), and, on sparse
layers, a mixture-of-experts MLP: a linear router picks the top-k experts of each token
(softmax in float32, optionally renormalised over the k), the experts' SwiGLU outputs are summed
with the router weights, and the talker's variant adds a shared expert scaled by a sigmoid
gate. Parameter names and tensor layouts are those of transformers' ``qwen3_omni_moe`` (experts
stored fused: ``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``).

The stack attends through the :class:`~mstar_async.models.llama.PagedAttention` seam, so the
same module runs on the paged KV engines and, with :class:`DenseCausalAttention`, on one dense
sequence (tests, and code2wav's sliding-window transformer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.engines.kv import AttentionSpec
from mstar_async.models.llama import PagedAttention, RMSNorm, RopeConfig, rotate

__all__ = ["DenseCausalAttention", "Qwen3Config", "Qwen3Stack", "RMSNorm", "seeded_init"]


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    """Shape of one Qwen3 decoder stack.

    Attributes:
        num_experts: 0 for a dense MLP on every layer.
        shared_expert_intermediate_size: > 0 adds the talker's gated shared expert.
        mlp_only_layers: layers that keep a dense MLP although ``num_experts`` > 0.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError: a size below 1, heads not a multiple of kv heads, an odd head
        dim, a top-k larger than the number of experts, or expert sizes not multiples of 8."""
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"Qwen3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ValueError(
                "Qwen3Config: num_attention_heads must be a multiple of num_key_value_heads and "
                f"head_dim even; got {self.num_attention_heads}, {self.num_key_value_heads}, "
                f"{self.head_dim}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_experts and (self.hidden_size % 8 or self.moe_intermediate_size % 8):
            # Grouped matmuls over the experts need rows of a multiple of 16 bytes.
            raise ValueError(
                "hidden_size and moe_intermediate_size must be multiples of 8 with experts, "
                f"got {self.hidden_size} and {self.moe_intermediate_size}"
            )

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` has the mixture-of-experts MLP (upstream's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def attention_spec(self, dtype: torch.dtype) -> AttentionSpec:
        """The KV cache / backend description for this stack."""
        return AttentionSpec(
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Qwen3Config:
        """Read a transformers text config dict (thinker ``text_config``, talker
        ``text_config``, ``code_predictor_config``).

        Raises:
            ValueError: a required key is missing, or an activation other than silu.
        """
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}; need silu")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
            intermediate = int(config["intermediate_size"])
        except KeyError as missing:
            raise ValueError(f"Qwen3 text config lacks {missing}") from None
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))
        return cls(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            # The talker's config.json spells it ``num_local_experts`` (an attribute alias).
            num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok", 1) or 1),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(
                config.get("shared_expert_intermediate_size", 0) or 0
            ),
        )


class _Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, *, qk_norm: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm: nn.Module = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else nn.Identity()
        )
        self.k_norm: nn.Module = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else nn.Identity()
        )

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedAttention,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = attention(layer, rotate(q, cos, sin), rotate(k, cos, sin), v)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    """SwiGLU MLP with upstream names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Router(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class _Experts(nn.Module):
    """The routed experts of one layer, run for every token of a forward at once.

    The ``tokens x top_k`` assignments are sorted by expert, so each expert's rows are one
    contiguous segment of a gathered copy of the input; both projections are grouped matmuls
    over those segments (``F.grouped_mm``, one kernel each: no loop over experts and no host
    sync, so the layer costs the same number of launches whichever experts are picked); the
    weighted outputs are summed back into their tokens with ``index_add_``.
    """

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """``x`` ``[n, hidden]``, router ``weights`` and ``experts`` ``[n, top_k]`` -> the
        weighted sum of each token's experts, ``[n, hidden]``. Never raises on valid shapes."""
        top_k = experts.shape[1]
        picked, order = torch.sort(experts.reshape(-1), stable=True)
        rows = order // top_k  # the token of each sorted assignment
        every = torch.arange(self.gate_up_proj.shape[0], device=picked.device)
        ends = torch.searchsorted(picked, every, right=True).to(torch.int32)
        gate, up = _grouped_linear(x[rows], self.gate_up_proj, ends).chunk(2, dim=-1)
        y = _grouped_linear(F.silu(gate) * up, self.down_proj, ends)
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, rows, y)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    # Rows ends[g-1]:ends[g] of x through weight[g] ([groups, out, in]), as F.linear would.
    out: torch.Tensor = F.grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    return out


class SparseMoE(nn.Module):
    """Top-k routed experts, plus (talker) a shared expert behind a sigmoid gate."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate = _Router(cfg)
        self.experts = _Experts(cfg)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out: torch.Tensor = self.experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class _Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoE(cfg) if cfg.sparse(index) else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: PagedAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.index, self.input_layernorm(x), cos, sin, attention)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Qwen3Stack(nn.Module):
    """Decoder layers and the final norm (upstream ``layers.{i}...`` and ``norm``); the owner
    adds its embedding table(s) as attributes, under their upstream names."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(_Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._inv_freq = RopeConfig(theta=cfg.rope_theta).inv_freq(cfg.head_dim)

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[n, 1, head_dim/2]``, computed in float32 then cast (as upstream).

        Text-only inputs give upstream's multimodal rotary (three equal position streams) the
        same frequencies as this one.
        """
        freqs = positions.to(torch.float32).unsqueeze(-1) * self._inv_freq.to(positions.device)
        return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)

    def forward(self, x: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """Run every layer over flat embeddings ``[n, hidden]``; return the normed hidden."""
        cos, sin = self.rotary(attention.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        out: torch.Tensor = self.norm(x)
        return out


class DenseCausalAttention:
    """:class:`PagedAttention` over one dense sequence: causal (optionally sliding-window)
    attention of the given tokens among themselves; keeps no cache."""

    def __init__(self, length: int, *, window: int | None = None, device: Any = "cpu") -> None:
        self.positions = torch.arange(length, device=device)
        idx = self.positions
        mask = idx[None, :] <= idx[:, None]
        if window is not None:
            mask &= (idx[:, None] - idx[None, :]) < window
        self._mask = mask

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out: torch.Tensor = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=self._mask
        )
        return out.transpose(0, 1)


_UNIT_SUFFIXES = ("norm.weight", "layer_scale.scale", ".gamma")


def seeded_init(module: nn.Module, seed: int, *, skip: Sequence[str] = ()) -> None:
    """Draw every parameter of ``module`` from a seeded generator, leaving the global RNG alone.

    Matrices (and conv kernels, expert stacks) ``N(0, 1/fan_in)`` so activations stay ``O(1)``;
    norm gains ``1 + N(0, 0.1)``; layer scales 0.1; 1-D vectors (biases, activations' ``alpha``
    / ``beta``) ``N(0, 0.1)``. Parameters whose name starts with a ``skip`` prefix are kept.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if any(name.startswith(prefix) for prefix in skip):
                continue
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1, generator=gen)
            elif name.endswith(("layer_scale.scale", "gamma")):
                param.fill_(0.1)
            elif param.dim() == 1:
                param.normal_(0.0, 0.1, generator=gen)
            else:
                # Conv kernels [out, in, k] read in*k inputs; expert stacks [E, out, in] read in.
                conv = param.dim() > 2 and ".experts." not in name
                fan_in = math.prod(param.shape[1:]) if conv else param.shape[-1]
                param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
