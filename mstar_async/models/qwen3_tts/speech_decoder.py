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

All after the quantizer and ``pre_conv`` is Qwen3-Omni code2wav's ``FrameDecoder`` (causal
convolutions, ConvNeXt, SnakeBeta, residual units, the layer-scaled transformer), with the two
differences of the 12 Hz decoder: its transposed convolutions trim only their right end, and its
transformer runs between projections from and back to ``latent_dim``.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_async.models.qwen3_omni.code2wav import CausalConv, FrameDecoder, chunked_decode
from mstar_async.models.qwen3_tts.config import SpeechDecoderConfig

__all__ = ["SpeechDecoder", "chunked_decode"]


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


class SpeechDecoder(FrameDecoder):
    """Codes ``[Q, frames]`` -> PCM; submodule names are upstream's (``decoder.*`` of the
    speech tokenizer)."""

    label = "the speech decoder"

    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quantizer = _SplitQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = self.transformer(cfg, latent=cfg.latent_dim)
        self.upsample = self.upsampler(cfg, cfg.latent_dim)
        self.decoder = self.waveform(cfg, cfg.latent_dim, trim_left=False)

    def embed_frames(self, codes: torch.Tensor) -> torch.Tensor:
        """The quantizer's vectors of each frame, widened by ``pre_conv`` to ``latent_dim``."""
        hidden = self.quantizer.decode(codes.long())
        rows: torch.Tensor = self.pre_conv(hidden[None])[0].T
        return rows
