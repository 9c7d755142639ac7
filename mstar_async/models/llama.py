"""A Llama / Qwen2-family decoder that keeps its K/V in a paged cache owned by someone else.

The module never sees blocks, slots or sequence boundaries. Everything about paging goes
through one seam, :class:`PagedAttention`: the caller (the KV-cache engine) plans a step, hands
the module an object that knows each query token's position, and that object attends each
layer's rotated ``q`` over its sequence's cached keys after storing this step's ``k`` / ``v``.

One step, as the engine drives it::

    attention = ...                                # planned for this step's flat batch
    hidden = decoder(input_ids, attention)         # [num_tokens, hidden], final norm applied
    logits = decoder.compute_logits(hidden[rows])  # only the rows that are sampled

Parameter names match Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` exactly, so
their state dicts load unchanged (:meth:`PagedDecoder.from_checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.engines.kv import AttentionSpec
from mstar_async.errors import EngineError
from mstar_async.models.checkpoints.streaming import (
    Piece,
    StateDictSource,
    TensorSource,
    empty_module,
    load_weights,
)
from mstar_async.models.quant.decoder import FORMS, check_form, quantize_linears

__all__ = [
    "QUANTIZED_HEAD_MAX_ROWS",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "DecoderConfig",
    "PagedAttention",
    "PagedDecoder",
    "RMSNorm",
    "RopeConfig",
    "rotate",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Hugging Face's fallback when a config names no rope base (``default_theta``).
_DEFAULT_ROPE_THETA = 10_000.0

# Torch's weight-only CPU kernels multiply one row at a time: for the 49,152 x 576 head of
# SmolLM2 int8 takes 7.6-9.6 ms for 1-4 rows and 17.8 ms for 8, where the bfloat16 matrix
# takes 11.3-13.2 ms for any of them (one thread, same run; two threads alike).
QUANTIZED_HEAD_MAX_ROWS = 4

# Keys older checkpoints saved for a buffer that is recomputed, never learned; Hugging Face
# skips them on load, and so do we.
_IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)


#: A layer's work on one side of its attention call (see ``PagedDecoder.compile_layers``).
Region = Callable[..., Any]


class PagedAttention(Protocol):
    """The only way :class:`PagedDecoder` touches the KV cache; implemented by the engine.

    ``positions`` is ``[num_tokens]`` int64 on the model's device: the absolute position of
    each query token in its own sequence (used for rotary embeddings). Calling the object
    with ``(layer, q, k, v)`` — ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` / ``v``
    ``[num_tokens, num_kv_heads, head_dim]``, rotary already applied to ``q`` and ``k`` — must
    store ``k`` / ``v`` for ``layer`` and return ``[num_tokens, num_heads, head_dim]``: causal
    attention of each query over its sequence's cached keys, this step's included.
    """

    @property
    def positions(self) -> torch.Tensor:
        """Absolute position of each query token, ``[num_tokens]`` int64."""
        ...

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store ``k`` / ``v`` for ``layer`` and attend ``q`` over the cached keys."""
        ...


# ---------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters.

    Attributes:
        theta: base wavelength.
        rope_type: ``"default"`` (no scaling), ``"linear"`` or ``"llama3"``.
        factor: frequency divisor (``linear`` and ``llama3``); 1.0 for ``default``.
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only: the pretraining context length.
    """

    theta: float = _DEFAULT_ROPE_THETA
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        """Check the parameters.

        Raises:
            ValueError: an unsupported ``rope_type``, or a parameter out of range.
        """
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not (math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"rope_theta must be a positive finite number, got {self.theta!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope factor must be a positive finite number, got {self.factor!r}")
        if self.rope_type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    "llama3 rope needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor!r} and {self.high_freq_factor!r}"
                )
            if self.original_max_position_embeddings < 1:
                raise ValueError(
                    "original_max_position_embeddings must be >= 1, got "
                    f"{self.original_max_position_embeddings!r}"
                )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Return the ``[head_dim // 2]`` float32 inverse frequencies, scaled per ``rope_type``.

        Follows the formulas of Hugging Face's rope initialisers, in float32 as they compute.
        """
        # An explicit CPU device: the module may be built under a ``torch.device("meta")``
        # context, and these frequencies must be real numbers.
        steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
        exponents = steps.to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            # Long wavelengths (beyond the pretraining context) are slowed by ``factor``, short
            # ones are kept, and the band in between is blended smoothly.
            old_len = self.original_max_position_embeddings
            low_freq_wavelen = old_len / self.low_freq_factor
            high_freq_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            blended = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
            return torch.where(medium, blended, scaled)
        return inv_freq


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shape and options of a Llama / Qwen2 decoder; build it with :meth:`from_hf`.

    Attributes:
        model_type: ``"llama"`` or ``"qwen2"``.
        qkv_bias: q/k/v projections have a bias (Qwen2 always; Llama when ``attention_bias``).
        o_bias: the output projection has a bias (Llama ``attention_bias``; never Qwen2).
        mlp_bias: gate/up/down projections have a bias (Llama ``mlp_bias``).
        eos_token_ids: every end-of-sequence id the config lists (may be empty).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Check sizes and head counts.

        Raises:
            ValueError: an unsupported ``model_type``, a size that is not a positive int,
                ``num_attention_heads`` not a multiple of ``num_key_value_heads``, an odd
                ``head_dim``, or a non-positive ``rms_norm_eps``.
        """
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")

    def attention_spec(self, dtype: torch.dtype) -> AttentionSpec:
        """The :class:`AttentionSpec` of a cache holding this decoder's K/V in ``dtype``."""
        return AttentionSpec(
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """Build from a Hugging Face ``config.json`` dict (``LlamaForCausalLM`` or
        ``Qwen2ForCausalLM``).

        Reads rope settings from ``rope_parameters`` (transformers 5) or from ``rope_theta`` plus
        ``rope_scaling`` (older files), whichever are present.

        Raises:
            ValueError: an unsupported ``model_type``, rope type, activation, partial rotary
                factor or sliding-window attention; a missing required key; or a value out of
                range.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        if model_type == "qwen2" and _uses_sliding_window(config):
            raise ValueError(
                "Qwen2 sliding-window attention is not supported (use_sliding_window / "
                "layer_types name sliding_attention); supported: full attention only"
            )

        def need(key: str) -> Any:
            if key not in config:
                raise ValueError(f"{model_type} config is missing required key {key!r}")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            attention_bias = bool(config.get("attention_bias", False))
            qkv_bias = o_bias = attention_bias
            mlp_bias = bool(config.get("mlp_bias", False))
        max_pos = int(config.get("max_position_embeddings", 2048))
        eos = config.get("eos_token_id")
        eos_list = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        bos = config.get("bos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(config, max_pos),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(int(e) for e in eos_list),
        )


def _uses_sliding_window(config: Mapping[str, Any]) -> bool:
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    # Upstream's default window is 4096 when the key is absent; None turns sliding off.
    if not config.get("use_sliding_window", False) or config.get("sliding_window", 4096) is None:
        return False
    # Upstream slides only layers at or past ``max_window_layers``.
    return int(config.get("max_window_layers", 28)) < int(config.get("num_hidden_layers", 0))


def _rope_from_hf(config: Mapping[str, Any], max_pos: int) -> RopeConfig:
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a dict, got {value!r}")
        if "rope_type" not in value and "type" not in value and "rope_theta" not in value:
            raise ValueError(
                f"{key} looks nested per layer type ({sorted(value)}); supported: one global "
                "rope setting"
            )
        params.update(value)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial!r}; supported: 1.0")
    theta = params.get("rope_theta", config.get("rope_theta")) or _DEFAULT_ROPE_THETA

    def need(key: str) -> Any:
        if key not in params:
            raise ValueError(f"rope type {rope_type!r} needs {key!r} in its rope parameters")
        return params[key]

    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(need("factor")))
    if rope_type == "llama3":
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", max_pos)
            ),
        )
    return RopeConfig(theta=float(theta))


# ---------------------------------------------------------------------------------- layers


class _Linear(nn.Linear):
    # Weights always come from a checkpoint or from ``random``'s seeded draw; skipping the
    # default init also keeps meta-device construction from importing torch's compiler stack.
    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """RMSNorm with statistics in float32 and the gain applied after casting back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the activation dtype, then back, then the gain: the
        # order Hugging Face uses, so bf16 results round the same way.
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[tokens, heads, head_dim]``. Never raises on shapes that
    broadcast."""
    # Rotate-half convention: dimension i pairs with i + head_dim/2. ``cos``/``sin`` are
    # [num_tokens, 1, head_dim/2] and broadcast over heads.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = _Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = _Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = _Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj: nn.Module = _Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedAttention,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = attention(layer, rotate(q, cos, sin), rotate(k, cos, sin), v)
        want = (n, self.num_heads, self.head_dim)
        if tuple(out.shape) != want:
            raise EngineError(f"attention returned shape {tuple(out.shape)}, expected {want}")
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class _MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj: nn.Module = _Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)
        self._qk_heads = cfg.num_attention_heads + cfg.num_key_value_heads
        self._intermediate = cfg.intermediate_size
        self._qkv_weight: torch.Tensor | None = None
        self._qkv_bias: torch.Tensor | None = None
        self._gate_up_weight: torch.Tensor | None = None
        self._gate_up_bias: torch.Tensor | None = None
        # Set by ``use_quantized``: fused projections that replace the float weights.
        self.qkv_proj: nn.Module | None = None
        self.gate_up_proj: nn.Module | None = None
        # The work before and after the attention call (``PagedDecoder.compile_layers``).
        self.regions: tuple[Region, Region] = (_before_attention, _after_attention)

    def fuse(self) -> None:
        """Lay q/k/v and gate/up out as one matrix each, the upstream parameters becoming views
        of it: one matmul instead of three (and two), no extra memory, same state dict. Does
        nothing for a quantized layer or one already fused; never raises."""
        if self.qkv_proj is not None or self._qkv_weight is not None:
            return
        attn, mlp = self.self_attn, self.mlp
        self._qkv_weight, self._qkv_bias = _fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self._gate_up_weight, self._gate_up_bias = _fuse_linears(mlp.gate_proj, mlp.up_proj)

    def use_quantized(
        self, qkv: nn.Module, o_proj: nn.Module, gate_up: nn.Module, down_proj: nn.Module
    ) -> None:
        """Run the projections through these modules (quantized linears: ``qkv`` gives the q,
        k and v rows in that order, ``gate_up`` the gate rows then the up rows) and drop the
        float q/k/v and gate/up projections. Never raises."""
        attn, mlp = self.self_attn, self.mlp
        for owner, name in (
            (attn, "q_proj"),
            (attn, "k_proj"),
            (attn, "v_proj"),
            (mlp, "gate_proj"),
            (mlp, "up_proj"),
        ):
            delattr(owner, name)
        attn.o_proj, mlp.down_proj = o_proj, down_proj
        self.qkv_proj, self.gate_up_proj = qkv, gate_up
        self._qkv_weight = self._qkv_bias = self._gate_up_weight = self._gate_up_bias = None

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_proj is not None:
            out: torch.Tensor = self.qkv_proj(x)
            return out
        if self._qkv_weight is None:
            self.fuse()
        assert self._qkv_weight is not None
        return F.linear(x, self._qkv_weight, self._qkv_bias)

    def _gate_up(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            out: torch.Tensor = self.gate_up_proj(x)
            return out
        if self._gate_up_weight is None:
            self.fuse()
        assert self._gate_up_weight is not None
        return F.linear(x, self._gate_up_weight, self._gate_up_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: PagedAttention
    ) -> torch.Tensor:
        before, after = self.regions
        q, k, v = before(self, x, cos, sin)
        out = attention(self.index, q, k, v)
        if out.shape != q.shape:
            raise EngineError(
                f"attention returned shape {tuple(out.shape)}, expected {tuple(q.shape)}"
            )
        result: torch.Tensor = after(self, x, out)
        return result


def _before_attention(
    layer: _DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's q (rotated), k (rotated) and v for its attention."""
    attn = layer.self_attn
    n, d = x.shape[0], attn.head_dim
    qkv = layer._qkv(layer.input_layernorm(x))
    split = layer._qk_heads * d
    qk = rotate(qkv[:, :split].view(n, layer._qk_heads, d), cos, sin)
    v = qkv[:, split:].view(n, attn.num_kv_heads, d)
    return qk[:, : attn.num_heads], qk[:, attn.num_heads :], v


def _after_attention(layer: _DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A layer's output given its input ``x`` and its attention's ``out``."""
    attn = layer.self_attn
    n = x.shape[0]
    x = x + attn.o_proj(out.reshape(n, attn.num_heads * attn.head_dim))
    gate_up = layer._gate_up(layer.post_attention_layernorm(x))
    hidden = F.silu(gate_up[:, : layer._intermediate]) * gate_up[:, layer._intermediate :]
    result: torch.Tensor = x + layer.mlp.down_proj(hidden)
    return result


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = (
            None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        )
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
    return weight, bias


class _Model(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# ---------------------------------------------------------------------------------- decoder


class PagedDecoder(nn.Module):
    """A Llama / Qwen2 causal LM over a flat, unpadded batch, attending through a
    :class:`PagedAttention`.

    Submodules are named as in Hugging Face (``model.embed_tokens``, ``model.layers.{i}...``,
    ``model.norm``, ``lm_head``), so its state dict is theirs. With tied embeddings
    ``lm_head.weight`` *is* ``model.embed_tokens.weight``.
    """

    def __init__(self, config: DecoderConfig) -> None:
        """Build the module with default-initialised weights (use :meth:`from_checkpoint` or
        :meth:`random` for real or seeded ones)."""
        super().__init__()
        self.config = config
        self.model = _Model(config)
        # A ``QuantLinear`` when the head is quantized (``use_quantized``).
        self.lm_head: nn.Module = _Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie()
        # Plain attributes, not buffers: ``.to(bfloat16)`` must not round the frequencies, and
        # they must not appear in the state dict.
        self._inv_freq = config.rope.inv_freq(config.head_dim)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def fuse(self) -> None:
        """Fuse every layer's projections now (``_DecoderLayer.fuse``) rather than at its first
        forward: a compiled forward must not meet the fusion's new parameters (a graph break
        that leaves each layer compiled apart, once per layer index). Never raises."""
        for layer in self.model.layers:
            assert isinstance(layer, _DecoderLayer)
            layer.fuse()

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run each layer's work before and after its attention call through ``torch.compile``
        (norms, projections, rotary, residuals and the MLP fused where the backend can): two
        graphs with dynamic token counts, shared by every layer, so a cold compile takes
        seconds where the whole step as one graph took many minutes on a small CPU; the
        attention stays as the engine planned it. Compiles on the first forward.
        Never raises here; the backend's errors come with that forward."""
        self.fuse()
        before = torch.compile(_before_attention, backend=backend, dynamic=True)
        after = torch.compile(_after_attention, backend=backend, dynamic=True)
        for layer in self.model.layers:
            assert isinstance(layer, _DecoderLayer)
            layer.regions = (before, after)

    def _tie(self) -> None:
        if self.config.tie_word_embeddings:
            assert isinstance(self.lm_head, nn.Linear)
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_quantized(
        self,
        layers: Sequence[tuple[nn.Module, nn.Module, nn.Module, nn.Module]],
        head: nn.Module | None,
    ) -> None:
        """Run each layer's projections through quantized linears, ``(qkv, o_proj, gate_up,
        down_proj)`` per layer (see ``_DecoderLayer.use_quantized``), and the head through
        ``head`` unless it is ``None``; the float weights they replace are dropped.

        Raises:
            ValueError: not one entry per layer.
        """
        if len(layers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers' linears, got {len(layers)}")
        for layer, linears in zip(self.model.layers, layers, strict=True):
            assert isinstance(layer, _DecoderLayer)
            layer.use_quantized(*linears)
        if head is not None:
            self.lm_head = head

    def _apply(self, fn: Any, recurse: bool = True) -> PagedDecoder:
        # .to() / .cuda() replace parameter storage: lay the fused matrices out again after.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for layer in self.model.layers:
            assert isinstance(layer, _DecoderLayer)
            layer._qkv_weight = layer._gate_up_weight = None
        return self

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_checkpoint(
        cls,
        config: Mapping[str, Any],
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedDecoder:
        """Build from a Hugging Face ``config.json`` dict and a state dict in memory, strictly
        (as :meth:`from_source`).

        Raises:
            ValueError: as :meth:`from_source`.
        """
        return cls.from_source(config, StateDictSource(state_dict), dtype=dtype, device=device)

    @classmethod
    def from_source(
        cls,
        config: Mapping[str, Any],
        source: TensorSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantize: str | None = None,
    ) -> PagedDecoder:
        """Build from a Hugging Face ``config.json`` dict, reading the weights tensor by tensor
        from ``source`` (a ``SafetensorsFolder`` streams them from disk) straight into ``dtype``
        on ``device``, strictly.

        With tied embeddings ``lm_head.weight`` may be absent (and is ignored if present: the
        head is the embedding, as upstream). ``*rotary_emb.inv_freq`` keys from old checkpoints
        are ignored. ``quantize`` (a name of ``quant.FORMS``: ``"int8"``, ``"int4"``) runs the
        layers' linears and the head through weight-only kernels, reading a GGUF source's
        blocks as they are and quantizing float weights as they are read; activations, the
        embedding and the norms stay in ``dtype``. Blocks on the reads.

        Raises:
            ValueError: the config is unsupported or invalid (see :meth:`DecoderConfig.from_hf`);
                ``dtype`` is not a floating type; ``quantize`` names no form; or keys are
                missing or unexpected, or shapes differ (the message lists them), found before
                any tensor is read.
            QuantizationUnsupported: ``quantize`` needs a kernel this torch lacks on ``device``.
            CheckpointError: a weight file cannot be read.
        """
        cfg = DecoderConfig.from_hf(config)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        check_form(quantize, device)
        model = empty_module(lambda: cls(cfg))
        consumed: set[str] = set()
        if quantize is not None:
            layers, head = FORMS[quantize]
            consumed = quantize_linears(
                model, source, layers, head=head, dtype=dtype, device=device
            )

        def claimed(name: str) -> bool:
            return (
                name not in consumed
                and not name.endswith(_IGNORED_KEY_SUFFIXES)
                and not (cfg.tie_word_embeddings and name == "lm_head.weight")
            )

        try:
            load_weights(
                model,
                source,
                lambda name, shape: [Piece(name)],
                dtype=dtype,
                device=device,
                claimed=claimed,
            )
        except ValueError as exc:
            raise ValueError(f"a {cfg.model_type} decoder with this config: {exc}") from None
        return model.eval()

    @classmethod
    def random(
        cls,
        config: DecoderConfig,
        seed: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedDecoder:
        """Build with seeded random weights, without touching the global RNG.

        Weights and embeddings are ``N(0, 1/fan_in)``-scaled so activations stay ``O(1)`` and
        attention is not uniform; biases ``N(0, 0.02)``; norm gains ``1 + N(0, 0.1)``. The same
        ``(config, seed)`` gives the same weights on every device (drawn on the CPU in float32,
        then cast).

        Raises:
            ValueError: ``dtype`` is not a floating type.
        """
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        model = cls._empty(config, torch.float32, "cpu")
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.1, generator=gen)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.02, generator=gen)
                else:
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=gen)
        model = model.to(device=device, dtype=dtype)
        model._tie()
        return model.eval()

    @classmethod
    def _empty(
        cls, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device | str
    ) -> PagedDecoder:
        # Build on the meta device and then allocate uninitialised storage: default
        # initialisation of a multi-billion-parameter model would take minutes for nothing.
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype=dtype).to_empty(device=device)
        model._tie()
        return model

    # ------------------------------------------------------------------ properties

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (the ``layer`` indices the attention is called with)."""
        return self.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of activations, q/k/v and the logits)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.model.embed_tokens.weight.device

    def attention_spec(self, dtype: torch.dtype | None = None) -> AttentionSpec:
        """Return the :class:`AttentionSpec` for a cache and backend serving this model.

        ``dtype`` defaults to the weights' dtype, which is the dtype of ``q`` / ``k`` / ``v``.
        The softmax scale is the default ``1 / sqrt(head_dim)``, as upstream.
        """
        return self.config.attention_spec(self.dtype if dtype is None else dtype)

    # ------------------------------------------------------------------ running

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Return ``(cos, sin)``, each ``[num_tokens, 1, head_dim // 2]`` in ``dtype``.

        Computed in float32 as ``position * inv_freq`` and then cast, as upstream does, so
        results match it bit for bit; computing them per step (one small elementwise op shared
        by every layer) needs no table and no host sync to size one.
        """
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq.to(positions.device)
            self._inv_freq_on[positions.device] = inv_freq
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """Run every layer over a flat batch; return ``[num_tokens, hidden]`` after the final norm.

        ``input_ids`` is ``[num_tokens]`` (all sequences' new tokens concatenated, as the
        attention was planned); positions come from ``attention.positions``.

        Raises:
            EngineError: ``input_ids`` is not 1-D integer, ``attention.positions`` does not
                have one entry per token, or the attention returns a wrongly shaped tensor.
        """
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32):
            raise EngineError(
                f"input_ids must be a 1-D int64 tensor, got {tuple(input_ids.shape)} "
                f"{input_ids.dtype}"
            )
        positions = attention.positions
        if tuple(positions.shape) != tuple(input_ids.shape):
            raise EngineError(
                f"attention.positions has shape {tuple(positions.shape)}, input_ids "
                f"{tuple(input_ids.shape)}"
            )
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        out: torch.Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project normed hidden states ``[n, hidden]`` (from :meth:`forward`) to ``[n, vocab]``
        logits, in the weights' dtype.

        A quantized head tied to the embedding runs only for a few rows: past
        ``QUANTIZED_HEAD_MAX_ROWS`` the float embedding it was read from (kept for the lookup
        anyway) is the faster matrix, so many rows multiply that instead.
        """
        if (
            hidden.shape[0] > QUANTIZED_HEAD_MAX_ROWS
            and self.config.tie_word_embeddings
            and not isinstance(self.lm_head, nn.Linear)
        ):
            return F.linear(hidden, self.model.embed_tokens.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
