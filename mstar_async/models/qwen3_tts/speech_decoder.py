"""The 12 Hz speech tokenizer's decoder: multi-codebook frames -> 24 kHz PCM (upstream names).

Upstream ``Qwen3TTSTokenizerV2Decoder``: the frame's codes are looked up in a split residual
vector quantizer (codebook 0 in ``rvq_first``, the rest in ``rvq_rest``; each codebook's
vectors are ``embedding_sum / cluster_usage``; the sums go through a 1x1 ``output_proj``); a
causal convolution (``pre_conv``) widens them to ``latent_dim``; a small causal
sliding-window transformer (``pre_transformer``, with ``input_proj`` / ``output_proj`` around
it) mixes frames; two transposed-conv + ConvNeXt stages and a SnakeBeta decoder upsample by
1920. Every layer is causal, so a window of frames decoded with left context gives the audio of
its new frames as a longer decode would, up to the transformer's 72-frame window: upstream's
``chunked_decode`` decodes with 25 frames of left context, and so does the stream here.

The layers shared with Qwen3-Omni's code2wav (causal convolutions, ConvNeXt, SnakeBeta,
residual units, the layer-scaled transformer layer) are that module's; the transposed
convolution differs (this one trims only its right end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mstar_async.models.qwen3_omni.code2wav import (
    CausalConv,
    ConvNeXtBlock,
    SnakeBeta,
    _ResidualUnit,
    _TransformerLayer,
)
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, RMSNorm
from mstar_async.models.qwen3_tts.config import SpeechDecoderConfig
from mstar_async.policies import Chunk

__all__ = ["SpeechDecoder", "chunked_decode"]


class CausalTransConv(nn.Module):
    """Transposed conv with its last ``kernel - stride`` samples cut (upstream's 12 Hz
    ``CausalTransConvNet``: no cut on the left)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out[..., : out.shape[-1] - self.trim] if self.trim else out


class _DecoderBlock(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig, index: int) -> None:
        super().__init__()
        cin, cout = cfg.decoder_dim // 2**index, cfg.decoder_dim // 2 ** (index + 1)
        rate = cfg.upsample_rates[index]
        units: list[nn.Module] = [SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate)]
        units += [_ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList(units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.block:
            x = unit(x)
        return x


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def vectors(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _Quantization(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _Layers(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Quantization(size, dim) for _ in range(count))


class _ResidualQuantizer(nn.Module):
    def __init__(self, count: int, size: int, dim: int, outer: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(outer, dim, 1, bias=False)  # encoding only; kept for names
        self.output_proj = nn.Conv1d(dim, outer, 1, bias=False)
        self.vq = _Layers(count, size, dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[k, frames]`` -> ``[outer, frames]``."""
        total = sum(
            layer._codebook.vectors()[c]  # type: ignore[union-attr,operator]
            for layer, c in zip(self.vq.layers, codes, strict=False)
        )
        assert isinstance(total, torch.Tensor)
        out: torch.Tensor = self.output_proj(total.T[None])[0]
        return out


class _SplitQuantizer(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        half = cfg.codebook_dim // 2
        self.rvq_first = _ResidualQuantizer(1, cfg.codebook_size, half, cfg.codebook_dim)
        self.rvq_rest = _ResidualQuantizer(
            cfg.num_quantizers - 1, cfg.codebook_size, half, cfg.codebook_dim
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:1]) + self.rvq_rest.decode(codes[1:])


class _PreTransformer(nn.Module):
    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        shape = cfg.transformer()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(
            _TransformerLayer(shape, i) for i in range(shape.num_hidden_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, shape.hidden_size)
        self.output_proj = nn.Linear(shape.hidden_size, cfg.latent_dim)
        steps = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device="cpu")
        self._inv_freq = 1.0 / (shape.rope_theta ** (steps / shape.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One sequence ``[frames, latent]`` -> ``[frames, latent]``."""
        x = self.input_proj(x)
        attention = DenseCausalAttention(x.shape[0], window=self.window, device=x.device)
        freqs = attention.positions.float().unsqueeze(-1) * self._inv_freq.to(x.device)
        cos, sin = freqs.cos().to(x.dtype).unsqueeze(1), freqs.sin().to(x.dtype).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        out: torch.Tensor = self.output_proj(self.norm(x))
        return out


class SpeechDecoder(nn.Module):
    """Codes ``[Q, frames]`` -> PCM; submodule names are upstream's (``decoder.*`` of the
    speech tokenizer)."""

    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quantizer = _SplitQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = _PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r),
                    ConvNeXtBlock(cfg.latent_dim),
                ]
            )
            for r in cfg.upsampling_ratios
        )
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        decoder: list[nn.Module] = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        decoder += [_DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
        decoder += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode ``[Q, frames]`` codes to ``[frames * 1920]`` PCM in [-1, 1].

        Raises:
            ValueError: the first dim is not ``num_quantizers``.
        """
        if codes.dim() != 2 or codes.shape[0] != self.config.num_quantizers:
            raise ValueError(
                f"the speech decoder expects codes [{self.config.num_quantizers}, frames], "
                f"got {tuple(codes.shape)}"
            )
        pcm: torch.Tensor = self.unclamped(codes).clamp(-1.0, 1.0)
        return pcm

    def unclamped(self, codes: torch.Tensor) -> torch.Tensor:
        """The waveform ``forward`` clamps, ``[samples]``: for calibrating seeded weights."""
        hidden = self.quantizer.decode(codes.long())
        hidden = self.pre_conv(hidden[None])[0].T
        x = self.pre_transformer(hidden).T[None]
        for stage in self.upsample:
            assert isinstance(stage, nn.ModuleList)
            for block in stage:
                x = block(x)
        for block in self.decoder:
            x = block(x)
        wave: torch.Tensor = x.reshape(-1)
        return wave

    def decode_window(self, frames: torch.Tensor, context: int) -> torch.Tensor:
        """PCM of a window of frames ``[n, Q]`` minus its first ``context`` frames' audio (the
        cut upstream's ``chunked_decode`` makes)."""
        pcm: torch.Tensor = self(frames.T.long())
        return pcm[context * self.config.total_upsample :]

    def decode(
        self,
        codes: Sequence[Chunk],
        prime: Sequence[torch.Tensor] | None = None,
        *,
        left_context: int = 25,
    ) -> dict[str, list[torch.Tensor]]:
        """StatelessEngine op: one PCM tensor (float32) per chunk, the audio of its new frames.

        ``prime`` (per chunk, ``[k, Q]``, possibly empty) are frames heard before the stream,
        a cloned voice's reference codes: a window with less left context than the policy's
        reaches back into them, as upstream decodes reference and generated codes as one
        sequence, up to ``left_context`` frames in all. A final chunk that brings no frame
        gives no audio.
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
                context += extra.shape[0]
            out.append(self.decode_window(frames, context).float())
        return {"pcm": out}


def chunked_decode(
    model: SpeechDecoder, frames: torch.Tensor, chunk: int, left: int
) -> torch.Tensor:
    """All-at-once reference: decode ``[n, Q]`` frames in windows of ``chunk`` new frames with
    up to ``left`` frames of left context and join the kept audio (upstream's
    ``chunked_decode`` with its ``chunk_size`` and ``left_context_size``)."""
    pieces = []
    for start in range(0, frames.shape[0], chunk):
        context = min(left, start)
        pieces.append(model.decode_window(frames[start - context : start + chunk], context))
    return torch.cat(pieces) if pieces else torch.zeros(0)
