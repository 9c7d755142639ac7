"""The speaker encoder: reference audio -> one speaker embedding (upstream's x-vector).

Upstream's ``Qwen3TTSSpeakerEncoder`` is an ECAPA-TDNN (Desplanques et al., 2020) over a
128-bin log-mel spectrogram of 24 kHz audio (FFT 1024, hop 256, Hann window 1024, slaney mel
filters 0-12 kHz, reflection padding of ``(n_fft - hop) / 2`` on both ends, no centring,
magnitude ``sqrt(re^2 + im^2 + 1e-9)``, ``log(max(x, 1e-5))``). Its output is a talker-width
vector that takes the speaker id's place in the talker's prompt. Parameter names are
upstream's (``speaker_encoder.*``). Every convolution pads ``same`` with reflection.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.qwen3_tts.config import SpeakerEncoderConfig

__all__ = ["SpeakerEncoder", "slaney_mel_filters", "speaker_mel"]

_N_FFT, _HOP, _WIN = 1024, 256, 1024


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    # Slaney's scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above.
    return torch.where(
        hz >= 1000.0, 15.0 + torch.log(hz / 1000.0) * (27.0 / math.log(6.4)), 3.0 * hz / 200.0
    )


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return torch.where(
        mel >= 15.0, 1000.0 * torch.exp((math.log(6.4) / 27.0) * (mel - 15.0)), 200.0 * mel / 3.0
    )


@functools.cache
def slaney_mel_filters(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float
) -> torch.Tensor:
    """Slaney-normalised triangular mel filters ``[n_mels, n_fft // 2 + 1]`` float32 (built in
    float64, as librosa's ``filters.mel`` with its defaults). Cached: do not modify the result."""
    bins = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, hi = (float(_hz_to_mel(torch.tensor(f, dtype=torch.float64))) for f in (fmin, fmax))
    centres = _mel_to_hz(torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64))
    widths = centres.diff()
    offsets = centres[None, :] - bins[:, None]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return (triangles * (2.0 / (centres[2:] - centres[:-2]))).T.float().contiguous()


def speaker_mel(pcm: torch.Tensor, sample_rate: int = 24_000, n_mels: int = 128) -> torch.Tensor:
    """Upstream's log-mel features of one utterance ``[samples]`` -> ``[frames, n_mels]``.

    Raises:
        ValueError: not a 1-D tensor, or shorter than one FFT window after padding.
    """
    if pcm.dim() != 1:
        raise ValueError(f"speaker_mel expects one utterance [samples], got {tuple(pcm.shape)}")
    pad = (_N_FFT - _HOP) // 2
    if pcm.numel() <= pad:
        raise ValueError(f"reference audio too short: {pcm.numel()} samples; need > {pad}")
    x = F.pad(pcm.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(
        x,
        _N_FFT,
        hop_length=_HOP,
        win_length=_WIN,
        window=torch.hann_window(_WIN),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    filters = slaney_mel_filters(sample_rate, _N_FFT, n_mels, 0.0, sample_rate / 2)
    mel = filters @ magnitude[0]
    return torch.log(torch.clamp(mel, min=1e-5)).T


class _TDNN(nn.Module):
    """Conv1d (same padding, reflect) + ReLU: upstream ``TimeDelayNetBlock``."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.relu(self.conv(x))
        return out


class _Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(_TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        prev: torch.Tensor | None = None
        for block, part in zip(self.blocks, parts[1:], strict=True):
            prev = block(part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, se: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se, 1)
        self.conv2 = nn.Conv1d(se, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class _SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: SpeakerEncoderConfig, i: int) -> None:
        super().__init__()
        kernel, dilation = cfg.enc_kernel_sizes[i], cfg.enc_dilations[i]
        self.tdnn1 = _TDNN(cin, cout, 1, 1)
        self.res2net_block = _Res2Net(cout, cfg.enc_res2net_scale, kernel, dilation)
        self.tdnn2 = _TDNN(cout, cout, 1, 1)
        self.se_block = _SqueezeExcite(cout, cfg.enc_se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))
        return h + x


class _AttentiveStatsPool(nn.Module):
    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(channels * 3, attention, 1, 1)
        self.conv = nn.Conv1d(attention, channels, 1)

    @staticmethod
    def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        var = (weights * (x - mean.unsqueeze(2)).pow(2)).sum(2)
        return mean, torch.sqrt(var.clamp(min=1e-12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        mean, std = self._stats(x, x.new_full((1, 1, frames), 1.0 / frames))
        context = torch.cat(
            [x, mean.unsqueeze(2).expand(-1, -1, frames), std.unsqueeze(2).expand(-1, -1, frames)],
            dim=1,
        )
        weights: torch.Tensor = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = self._stats(x, weights)
        pooled: torch.Tensor = torch.cat([mean, std], dim=1).unsqueeze(2)
        return pooled


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN with upstream's submodule names: ``blocks`` (a TDNN, then SE-Res2Net
    blocks), ``mfa``, ``asp``, ``fc``.

    Raises:
        ValueError: channel, kernel and dilation lists of different lengths.
    """

    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        ch = cfg.enc_channels
        if not len(ch) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        self.config = cfg
        blocks: list[nn.Module] = [
            _TDNN(cfg.mel_dim, ch[0], cfg.enc_kernel_sizes[0], cfg.enc_dilations[0])
        ]
        blocks += [_SERes2NetBlock(ch[i - 1], ch[i], cfg, i) for i in range(1, len(ch) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = _TDNN(ch[-1], ch[-1], cfg.enc_kernel_sizes[-1], cfg.enc_dilations[-1])
        self.asp = _AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """``[batch, frames, mel_dim]`` -> ``[batch, enc_dim]``."""
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        out: torch.Tensor = self.fc(self.asp(x)).squeeze(-1)
        return out

    def embed(self, pcm: torch.Tensor) -> torch.Tensor:
        """One utterance of 24 kHz PCM ``[samples]`` -> its embedding ``[enc_dim]`` (float32).
        Blocks (a CPU/GPU forward).

        Raises:
            ValueError: as ``speaker_mel``.
        """
        param = next(self.parameters())
        mel = speaker_mel(pcm, self.config.sample_rate, self.config.mel_dim)
        with torch.inference_mode():
            out: torch.Tensor = self(mel[None].to(param.device, param.dtype))[0]
        return out.float().cpu()
