"""The code2wav vocoder: multi-codebook codec frames -> 24 kHz PCM (upstream names).

Architecture of transformers' ``Qwen3OmniMoeCode2Wav``: the ``Q`` codes of a frame are embedded
from one shared table (offset by ``codebook * codebook_size``) and averaged; a small causal
transformer with sliding-window attention (``pre_transformer``, layer-scaled residuals, no q/k
norm) mixes frames; two transposed-conv + ConvNeXt stages upsample; a causal convolutional
decoder (SnakeBeta activations, upsampling blocks with dilated residual units) makes the
waveform, clamped to [-1, 1]. Every convolution is causal, so decoding a window of frames and
keeping the audio of its last frames is exact streaming under left context.

Everything after the frames' embedding is ``FrameDecoder``, which Qwen3-TTS's 12 Hz speech
decoder shares (its transposed convolutions trim only their right end, and projections to and
from its latent width wrap the transformer).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.hf_config import known_fields
from mstar_async.models.qwen3_omni.decoder import (
    MLP,
    DenseCausalAttention,
    Qwen3Config,
    RMSNorm,
)
from mstar_async.models.qwen3_omni.decoder import _Attention as _SelfAttention
from mstar_async.policies import Chunk

__all__ = [
    "Code2Wav",
    "Code2WavConfig",
    "ConvTails",
    "FrameDecoder",
    "VoiceTails",
    "chunked_decode",
]


@dataclass(frozen=True)
class Code2WavConfig:
    """Sizes of code2wav (upstream ``Qwen3OmniMoeCode2WavConfig`` field names)."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as upstream without the key

    @property
    def total_upsample(self) -> int:
        """PCM samples per frame."""
        return math.prod(self.upsample_rates + self.upsampling_ratios)

    def transformer(self) -> Qwen3Config:
        """The ``pre_transformer`` as a decoder stack shape."""
        return Qwen3Config(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Self:
        """Read upstream's ``code2wav_config`` (or 12 Hz ``decoder_config``) dict; absent keys
        keep upstream's defaults. Raises ValueError: a ``rope_theta`` that is not a number."""
        kwargs = known_fields(cls, config)
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)


class CausalConv(nn.Module):
    """Conv1d padded on the left so output ``t`` sees inputs ``<= t`` (upstream's CausalConvNet)."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        *,
        dilation: int = 1,
        stride: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.padding = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = math.ceil((length - self.span + self.padding) / self.stride + 1)
        extra = (frames - 1) * self.stride + (self.span - self.padding) - length
        out: torch.Tensor = self.conv(F.pad(x, (self.padding, extra)))
        return out


class CausalTransConv(nn.Module):
    """Transposed conv cut by ``kernel - stride`` at its end, and at its start too unless
    ``trim_left`` is false (upstream's CausalTransConvNet; the 12 Hz tokenizer's cuts only the
    end)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int, *, trim_left: bool = True
    ) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride
        self.left = self.trim if trim_left else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out[..., self.left : out.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv, LayerNorm, 4x pointwise MLP, scaled residual (upstream's)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, self.dwconv(x))

    def finish(self, x: torch.Tensor, convolved: torch.Tensor) -> torch.Tensor:
        """The block's output given its depthwise convolution's."""
        h = self.norm(convolved.transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        out: torch.Tensor = x + h.transpose(1, 2)
        return out


class SnakeBeta(nn.Module):
    """``x + sin(x * e^alpha)^2 / e^beta`` per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        out: torch.Tensor = x + torch.sin(x * alpha).pow(2) / (beta + 1e-9)
        return out


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, self.conv1(self.act1(x)))

    def finish(self, x: torch.Tensor, convolved: torch.Tensor) -> torch.Tensor:
        """The unit's output given its first convolution's."""
        out: torch.Tensor = x + self.conv2(self.act2(convolved))
        return out


class _DecoderBlock(nn.Module):
    def __init__(self, cfg: Code2WavConfig, index: int, trim_left: bool) -> None:
        super().__init__()
        cin, cout = cfg.decoder_dim // 2**index, cfg.decoder_dim // 2 ** (index + 1)
        rate = cfg.upsample_rates[index]
        up = CausalTransConv(cin, cout, 2 * rate, rate, trim_left=trim_left)
        units: list[nn.Module] = [SnakeBeta(cin), up]
        units += [_ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList(units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.block:
            x = unit(x)
        return x


class _LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _SelfAttention(cfg, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.self_attn_layer_scale = _LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = _LayerScale(cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Any
    ) -> torch.Tensor:
        attn = self.self_attn(self.index, self.input_layernorm(x), cos, sin, attention)
        x = x + self.self_attn_layer_scale(attn)
        out: torch.Tensor = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return out


class _PreTransformer(nn.Module):
    """The sliding-window transformer over frames; with ``latent``, projections from and back
    to that width around it (``input_proj`` / ``output_proj``, the 12 Hz decoder's)."""

    def __init__(self, cfg: Code2WavConfig, latent: int | None = None) -> None:
        super().__init__()
        shape = cfg.transformer()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(
            _TransformerLayer(shape, i) for i in range(shape.num_hidden_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        width = shape.hidden_size
        self.input_proj = nn.Identity() if latent is None else nn.Linear(latent, width)
        self.output_proj = nn.Identity() if latent is None else nn.Linear(width, latent)
        # Explicit device: a module built on the meta device still needs its frequencies.
        steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device="cpu")
        self._inv_freq = 1.0 / (shape.rope_theta ** (steps / shape.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One sequence ``[frames, width]`` -> ``[frames, width]``."""
        x = self.input_proj(x)
        attention = DenseCausalAttention(x.shape[0], window=self.window, device=x.device)
        freqs = attention.positions.float().unsqueeze(-1) * self._inv_freq.to(x.device)
        cos, sin = freqs.cos().to(x.dtype).unsqueeze(1), freqs.sin().to(x.dtype).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        out: torch.Tensor = self.output_proj(self.norm(x))
        return out


class FrameDecoder(nn.Module):
    """Frames of ``Q`` codes -> PCM: the part code2wav and the 12 Hz speech decoder share.

    A subclass embeds codes ``[Q, frames]`` as rows ``[frames, width]`` (``embed_frames``)
    and builds, in upstream's order, ``pre_transformer`` (``transformer``), ``upsample``
    (``upsampler``) and ``decoder`` (``waveform``); all after the embedding is here.
    """

    #: What error messages call the model.
    label: ClassVar[str] = "the decoder"
    config: Code2WavConfig
    pre_transformer: _PreTransformer
    upsample: nn.ModuleList
    decoder: nn.ModuleList

    def __init__(self) -> None:
        super().__init__()
        self._skips: dict[int, int] = {}  # ``frames_to_skip`` by context: fixed by the layers

    @staticmethod
    def transformer(cfg: Code2WavConfig, latent: int | None = None) -> _PreTransformer:
        """The ``pre_transformer`` (see ``_PreTransformer``)."""
        return _PreTransformer(cfg, latent)

    @staticmethod
    def upsampler(cfg: Code2WavConfig, width: int) -> nn.ModuleList:
        """The ``upsample`` stages: a transposed conv (stride = kernel, nothing to trim) and a
        ConvNeXt block per ratio."""
        return nn.ModuleList(
            nn.ModuleList([CausalTransConv(width, width, r, r), ConvNeXtBlock(width)])
            for r in cfg.upsampling_ratios
        )

    @staticmethod
    def waveform(cfg: Code2WavConfig, width: int, *, trim_left: bool = True) -> nn.ModuleList:
        """The convolutional ``decoder`` from ``width`` channels to one (see
        ``CausalTransConv`` for ``trim_left``)."""
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        blocks: list[nn.Module] = [CausalConv(width, cfg.decoder_dim, 7)]
        blocks += [_DecoderBlock(cfg, i, trim_left) for i in range(len(cfg.upsample_rates))]
        blocks += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        return nn.ModuleList(blocks)

    def embed_frames(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[Q, frames]`` -> rows ``[frames, width]`` for the transformer."""
        raise NotImplementedError

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode ``[Q, frames]`` codes to ``[frames * total_upsample]`` PCM in [-1, 1].

        Raises:
            ValueError: the first dim is not ``num_quantizers``.
        """
        if codes.dim() != 2 or codes.shape[0] != self.config.num_quantizers:
            raise ValueError(
                f"{self.label} expects codes [{self.config.num_quantizers}, frames], "
                f"got {tuple(codes.shape)}"
            )
        pcm: torch.Tensor = self.unclamped(codes).clamp(-1.0, 1.0)
        return pcm

    def unclamped(self, codes: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """The waveform ``forward`` clamps, ``[samples]``: for calibrating seeded weights.
        ``skip`` leading frames go through the transformer only (their audio is not made)."""
        x = self.pre_transformer(self.embed_frames(codes))[skip:].T[None]
        for block in self._convolutions():
            x = block(x)
        wave: torch.Tensor = x.reshape(-1)
        return wave

    def _convolutions(self) -> list[nn.Module]:
        """The layers after the transformer, in order."""
        stages = [block for stage in self.upsample for block in stage]  # type: ignore[attr-defined]
        return [*stages, *self.decoder]

    def frames_to_skip(self, context: int) -> int:
        """How many of a window's ``context`` leading frames the convolutions after the
        transformer can leave out and still give the new frames' audio exactly: those before
        the stack's receptive field (about 10 frames at upstream's shapes, against 25 of
        context). The transformer still attends over all of them."""
        skip = self._skips.get(context)
        if skip is None:
            first = context * self.config.total_upsample
            for block in reversed(self._convolutions()):
                first = _earliest_input(block, first)
            skip = self._skips[context] = max(0, min(context, first))
        return skip

    def conv_tails(self, frames: torch.Tensor) -> ConvTails:
        """The convolutions' state after decoding frames ``[n, Q]`` from a stream's start:
        what ``decode_after`` continues from.

        Raises:
            ValueError: a layer that looks ahead (code2wav's transposed convolutions).
        """
        rows = self.pre_transformer(self.embed_frames(frames.T.long())).T[None]
        tails: ConvTails = {}
        _stream(self._convolutions(), rows, {}, tails)
        return tails

    def decode_after(self, frames: torch.Tensor, context: int, tails: ConvTails) -> torch.Tensor:
        """What ``decode_window(frames, context)`` gives, when ``tails`` is ``conv_tails`` of
        the first ``context`` frames: their convolutions are not run again, only the
        transformer sees them. For a stream that always starts with the same frames (a
        registered voice's reference codes).

        Raises:
            ValueError: as ``conv_tails``.
        """
        rows = self.pre_transformer(self.embed_frames(frames.T.long()))[context:].T[None]
        wave = _stream(self._convolutions(), rows, tails, {})
        return wave.reshape(-1).clamp(-1.0, 1.0)

    def decode_window(self, frames: torch.Tensor, context: int) -> torch.Tensor:
        """PCM of a window of frames ``[n, Q]`` minus its first ``context`` frames' audio (the
        cut upstream's ``chunked_decode`` makes); the convolutions run only over the frames
        the kept audio depends on (``frames_to_skip``).

        Raises:
            ValueError: frames without ``num_quantizers`` codes.
        """
        if frames.dim() != 2 or frames.shape[1] != self.config.num_quantizers:
            raise ValueError(
                f"{self.label} expects frames [n, {self.config.num_quantizers}], "
                f"got {tuple(frames.shape)}"
            )
        skip = self.frames_to_skip(context)
        pcm = self.unclamped(frames.T.long(), skip).clamp(-1.0, 1.0)
        return pcm[(context - skip) * self.config.total_upsample :]

    def decode(
        self,
        codes: Sequence[Chunk],
        prime: Sequence[torch.Tensor] | None = None,
        voice: Sequence[str] | None = None,
        *,
        left_context: int = 0,
        voices: VoiceTails | None = None,
    ) -> dict[str, list[torch.Tensor]]:
        """StatelessEngine op: one PCM tensor (float32) per chunk of frames, the audio of its new
        frames; empty for a final chunk that brings none. Look-ahead frames are not decoded:
        every convolution is causal, so they cannot change the new frames' audio.

        ``prime`` (per chunk, ``[k, Q]``, possibly empty) are frames heard before the stream,
        a cloned voice's reference codes: a window with less left context than the policy's
        reaches back into them, as upstream decodes reference and generated codes as one
        sequence, up to ``left_context`` frames in all. ``voice`` (per chunk, a registered
        voice's key or "") lets the stream's first window continue from the convolution state
        after the voice's prime, kept in ``voices``, instead of convolving the prime again.
        """
        out = []
        for i, chunk in enumerate(codes):
            if not len(chunk.new):
                out.append(torch.zeros(0))
                continue
            assert isinstance(chunk.data, torch.Tensor)
            frames = chunk.data[: len(chunk.data) - chunk.lookahead].long()
            context = chunk.context
            before = prime[i] if prime is not None else None
            if before is not None and before.numel() and chunk.start == 0:
                want = max(0, left_context - context)
                extra = before[before.shape[0] - min(want, before.shape[0]) :].long()
                frames = torch.cat([extra.to(frames.device), frames])
                key = voice[i] if voice is not None else ""
                if voices is not None and key and not context and len(extra):
                    tails = voices.tails(key, extra, self.conv_tails)
                    out.append(self.decode_after(frames, len(extra), tails).float())
                    continue
                context += extra.shape[0]
            out.append(self.decode_window(frames, context).float())
        return {"pcm": out}


class Code2Wav(FrameDecoder):
    """Codes ``[Q, frames]`` -> PCM; submodule names are upstream's (``code2wav.*``)."""

    label = "code2wav"

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.config = cfg
        self.pre_transformer = self.transformer(cfg)
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        self.upsample = self.upsampler(cfg, cfg.hidden_size)
        self.decoder = self.waveform(cfg, cfg.hidden_size)
        offsets = torch.arange(cfg.num_quantizers, device="cpu")  # not meta (see _inv_freq)
        self._offset = offsets[:, None] * cfg.codebook_size

    def embed_frames(self, codes: torch.Tensor) -> torch.Tensor:
        """The mean of each frame's ``Q`` code embeddings (one table, offset per codebook)."""
        rows: torch.Tensor = self.code_embedding(codes + self._offset.to(codes.device)).mean(0)
        return rows


#: A decoder's convolution state after some frames: each causal layer's last inputs.
ConvTails = dict[nn.Module, torch.Tensor]


class VoiceTails:
    """The decoder's convolution state after each registered voice's prime frames, made on
    a voice's first request and reused by its later ones; at most ``limit`` voices, the least
    recently used dropped first. Not thread-safe: one engine's forwards run one at a time."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._held: OrderedDict[str, tuple[torch.Tensor, ConvTails]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def tails(
        self, key: str, frames: torch.Tensor, make: Callable[[torch.Tensor], ConvTails]
    ) -> ConvTails:
        """The state after ``frames`` for voice ``key``: kept, or ``make(frames)`` kept now
        (also when the voice's frames differ from those kept)."""
        held = self._held.get(key)
        if held is not None and torch.equal(held[0], frames):
            self._held.move_to_end(key)
            return held[1]
        tails = make(frames)
        self._held[key] = (frames.clone(), tails)
        self._held.move_to_end(key)
        while len(self._held) > self.limit:
            self._held.popitem(last=False)
        return tails

    def forget(self, handle: Sequence[str]) -> dict[str, list[bool]]:
        """StatelessEngine op: drop each voice's state; whether it was kept."""
        return {"dropped": [self._held.pop(key, None) is not None for key in handle]}


def _joined(
    layer: nn.Module,
    width: int,
    x: torch.Tensor,
    past: Mapping[nn.Module, torch.Tensor],
    tails: ConvTails,
) -> torch.Tensor:
    """``x`` after ``layer``'s last ``width`` inputs in ``past`` (zeros: a stream's start);
    its own last ``width`` go into ``tails``."""
    before = past.get(layer)
    if before is None:
        before = x.new_zeros(*x.shape[:-1], width)
    joined = torch.cat([before, x], -1)
    tails[layer] = joined[..., joined.shape[-1] - width :]
    return joined


def _stream(
    module: nn.Module | list[nn.Module],
    x: torch.Tensor,
    past: Mapping[nn.Module, torch.Tensor],
    tails: ConvTails,
) -> torch.Tensor:
    """``module``'s output for inputs ``x`` that follow those ``past`` saw, as if one input.

    Raises:
        ValueError: a layer that looks ahead or is not known here.
    """
    if isinstance(module, (list, nn.ModuleList)):
        for layer in module:
            x = _stream(layer, x, past, tails)
        return x
    out: torch.Tensor
    if isinstance(module, CausalConv) and module.stride == 1:
        joined = _joined(module, module.padding, x, past, tails) if module.padding else x
        out = module.conv(joined)
    elif isinstance(module, CausalTransConv) and not module.left:
        stride, kernel = module.conv.stride[0], module.conv.kernel_size[0]
        width = -(-(kernel - stride) // stride)  # earlier inputs whose outputs overlap ours
        joined = _joined(module, width, x, past, tails) if width else x
        out = module(joined)[..., width * stride :]
    elif isinstance(module, ConvNeXtBlock):
        out = module.finish(x, _stream(module.dwconv, x, past, tails))
    elif isinstance(module, _ResidualUnit):
        out = module.finish(x, _stream(module.conv1, module.act1(x), past, tails))
    elif isinstance(module, _DecoderBlock):
        out = _stream(module.block, x, past, tails)
    elif isinstance(module, SnakeBeta):
        out = module(x)
    else:
        raise ValueError(f"a stream cannot continue through {type(module).__name__}")
    return out


def _earliest_input(module: nn.Module, first: int) -> int:
    """The earliest input position ``module``'s outputs from ``first`` on depend on (inputs
    and outputs indexed from the window's start; a module not known here needs all)."""
    if isinstance(module, CausalConv):
        return first - module.padding if module.stride == 1 else 0
    if isinstance(module, CausalTransConv):
        # Raw output j sums inputs t with t * stride <= j <= t * stride + kernel - 1.
        stride, kernel = module.conv.stride[0], module.conv.kernel_size[0]
        return (first + module.left - kernel) // stride + 1
    if isinstance(module, ConvNeXtBlock):
        return _earliest_input(module.dwconv, first)
    if isinstance(module, _ResidualUnit):
        return _earliest_input(module.conv1, _earliest_input(module.conv2, first))
    if isinstance(module, _DecoderBlock):
        for unit in reversed(module.block):
            first = _earliest_input(unit, first)
        return first
    if isinstance(module, SnakeBeta):
        return first
    return 0


def chunked_decode(
    model: FrameDecoder, frames: torch.Tensor, chunk: int, left: int
) -> torch.Tensor:
    """All-at-once reference: decode ``[n, Q]`` frames in windows of ``chunk`` new frames with
    up to ``left`` frames of left context and join the kept audio (upstream's
    ``chunked_decode`` with its ``chunk_size`` and ``left_context_size``)."""
    pieces = []
    for start in range(0, frames.shape[0], chunk):
        context = min(left, start)
        pieces.append(model.decode_window(frames[start - context : start + chunk], context))
    return torch.cat(pieces) if pieces else torch.zeros(0)
