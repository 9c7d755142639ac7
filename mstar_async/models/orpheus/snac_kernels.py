"""SNAC's decoder rebuilt for serving: many windows in one forward, weights prepared once.

The ``snac`` package's modules stay the reference (the parity tests run them); this is the same
computation with what profiling a window of the ``small`` codec on one CPU thread showed to be
waste taken out:

- **Weight norm folded at load.** snac wraps every convolution in a weight-norm
  parametrization, recomputed on every call (38 norms per window, 6% of its profiled time
  before their Python overhead); here each weight is computed once.
- **Dilated depthwise convolutions as seven shifted multiply-adds.** oneDNN runs the residual
  units' dilated depthwise convolutions 3-5x slower than their undilated ones; seven
  ``addcmul`` passes, each onto the part of the output its shift keeps inside the input (the
  zero padding, without copying a padded input), cost the same at any dilation (dilation 1
  stays on oneDNN, which is faster there).
- **Snake in place** (``snake``): one new tensor instead of four.
- **Batches sliced where activations get wide** (``max_elements``): fresh tensors of a few
  MB cost page faults here, so four windows as one ``[4, 16, 8192]`` batch cost more per
  window than one at a time; the narrow early layers run batched, the wide late ones in
  slices.
- **Noise per window.** snac's noise blocks draw ``randn(B, 1, T)`` from the global generator,
  so a window's samples would depend on the windows batched with it. ``window_noise`` draws
  each window's noise from its own seeded generator in the order snac draws it, so a window
  decodes to the same samples alone or in any batch, and equal to snac's ``decode`` under
  ``torch.manual_seed(seed)`` (within float rounding: see ``SnacKernels``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SnacKernels", "snake"]


def snake(x: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``x + gain * sin(scale * x) ** 2`` (SNAC's ``Snake1d``: ``scale = alpha``, ``gain =
    1 / (alpha + 1e-9)``), per channel, computed in place on one new tensor.

    The textbook form allocates a tensor per op, and on CPU a fresh tensor larger than the
    cache costs page faults on first touch: on one thread this measured 12% faster on the
    ``small`` codec's widest activation (``[1, 16, 8192]``, where the sine dominates) and 2-3x
    on activations of a few hundred thousand values and more. The same ops as snac's form, so
    the same rounding. Pure; never raises for broadcastable shapes.
    """
    wave = torch.mul(x, scale)
    wave.sin_()
    wave.mul_(wave)
    wave.mul_(gain)
    return wave.add_(x)


def _weight(module: Any) -> torch.Tensor:
    # A weight-norm parametrization computes ``weight`` on access: read it once, folded.
    weight: torch.Tensor = module.weight
    return weight.detach().clone()


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().clone()


class _Conv(nn.Module):
    weight: torch.Tensor
    bias: torch.Tensor | None
    taps: torch.Tensor

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.register_buffer("weight", _weight(conv))
        self.register_buffer("bias", _bias(conv))
        self.stride, self.dilation, self.groups = conv.stride[0], conv.dilation[0], conv.groups
        self.padding = int(conv.padding[0])
        kernel = conv.kernel_size[0]
        self.shifted = (
            self.dilation > 1
            and self.stride == 1
            and conv.groups == conv.in_channels == conv.out_channels
            and self.padding == self.dilation * (kernel - 1) // 2
            and self.padding % self.dilation == 0
        )
        if self.shifted:
            # [kernel, channels, 1]: tap k scales every channel of the input shifted by k * d.
            self.register_buffer("taps", self.weight[:, 0, :].T.unsqueeze(-1).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shifted:
            out: torch.Tensor = F.conv1d(
                x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
            )
            return out
        return self._shifted(x)

    def _shifted(self, x: torch.Tensor) -> torch.Tensor:
        # "Same" padding: tap k reads the input shifted by k * d - padding. The centre tap
        # covers every output; the others add onto the part their shift keeps inside the
        # input, which is what zero padding gives without copying a padded input.
        taps, d, length = self.taps, self.dilation, x.shape[-1]
        centre = self.padding // d
        out = torch.mul(x, taps[centre])
        for k in range(taps.shape[0]):
            shift = k * d - self.padding
            if k == centre or abs(shift) >= length:
                continue
            if shift > 0:
                out[..., : length - shift].addcmul_(x[..., shift:], taps[k])
            else:
                out[..., -shift:].addcmul_(x[..., : length + shift], taps[k])
        if self.bias is not None:
            out.add_(self.bias[:, None])
        return out


class _TransConv(nn.Module):
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, conv: nn.ConvTranspose1d) -> None:
        super().__init__()
        self.register_buffer("weight", _weight(conv))
        self.register_buffer("bias", _bias(conv))
        self.stride = conv.stride[0]
        self.padding = int(conv.padding[0])
        self.output_padding = conv.output_padding[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.conv_transpose1d(
            x, self.weight, self.bias, self.stride, self.padding, self.output_padding
        )
        return out


class _Snake(nn.Module):
    scale: torch.Tensor
    gain: torch.Tensor

    def __init__(self, alpha: torch.Tensor) -> None:
        super().__init__()
        alpha = alpha.detach().reshape(1, -1, 1).clone()
        self.register_buffer("scale", alpha)
        self.register_buffer("gain", (alpha + 1e-9).reciprocal())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.scale, self.gain)


class _Noise(nn.Module):
    """``x + noise * (W x)``, the noise given per window instead of drawn here."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.linear = _Conv(conv)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x, noise, self.linear(x))


class _Residual(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.block(x)
        return out


class _Codebook(nn.Module):
    """One quantizer's codes -> its share of the latent (snac's ``from_codes``)."""

    table: torch.Tensor

    def __init__(self, quantizer: Any) -> None:
        super().__init__()
        self.register_buffer("table", quantizer.codebook.weight.detach().clone())
        self.out_proj = _Conv(quantizer.out_proj)
        self.stride = int(quantizer.stride)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z: torch.Tensor = self.out_proj(F.embedding(codes, self.table).transpose(1, 2))
        return z.repeat_interleave(self.stride, dim=-1)


def _convert(module: Any) -> list[nn.Module]:
    """snac's decoder module -> the same computation, flattened to top-level layers."""
    name = type(module).__name__
    if isinstance(module, nn.Conv1d):
        return [_Conv(module)]
    if isinstance(module, nn.ConvTranspose1d):
        return [_TransConv(module)]
    if name == "Snake1d":
        return [_Snake(module.alpha)]
    if name == "NoiseBlock":
        return [_Noise(module.linear)]
    if name == "ResidualUnit":
        # snac crops the residual when the block shortens it; its "same" padding never does.
        return [_Residual([layer for child in module.block for layer in _convert(child)])]
    if name == "DecoderBlock":
        return [layer for child in module.block for layer in _convert(child)]
    # Tanh, and LocalMHA in configs with attention: deterministic and batch-safe as they are.
    return [copy.deepcopy(module)]


class SnacKernels(nn.Module):
    """The decoder half of a ``snac.SNAC`` (``snac.decode``), batched over windows.

    ``forward(codes, noise)`` takes each codebook's codes ``[B, T_i]`` of ``B`` windows of the
    same length and their noise (``window_noise`` per window, stacked) and returns PCM
    ``[B, 1, samples]``. In float32 it equals ``snac.decode`` under
    ``torch.manual_seed(seed)`` within 1e-5 (the shifted convolutions sum in another order);
    cast with ``.to(torch.bfloat16)`` for the bfloat16 codec. A batch whose activation passes
    ``max_elements`` runs on in slices of windows. The weights are copied, so ``snac`` may be
    changed or dropped afterwards. Synchronous and holds no state between calls, so it can be
    abandoned at any point.

    Raises:
        ValueError (construction): ``snac`` has no ``quantizer`` and ``decoder.model``.
    """

    def __init__(self, snac: Any, max_elements: int = 1 << 17) -> None:
        super().__init__()
        if not hasattr(snac, "quantizer") or not hasattr(snac, "decoder"):
            raise ValueError("SnacKernels needs a snac.SNAC (with quantizer and decoder)")
        self.codebooks = nn.ModuleList(_Codebook(q) for q in snac.quantizer.quantizers)
        self.latent_rate = int(snac.quantizer.quantizers[0].stride)
        self.layers = nn.ModuleList(
            layer for module in snac.decoder.model for layer in _convert(module)
        )
        self.noise_rates = self._noise_rates()
        self.max_elements = max_elements

    def _noise_rates(self) -> list[int]:
        # Each noise block follows its block's upsampling: it sees latent length * the
        # product of the strides so far.
        rates, rate = [], 1
        for layer in self.layers:
            if isinstance(layer, _TransConv):
                rate *= layer.stride
            elif isinstance(layer, _Noise):
                rates.append(rate)
        return rates

    def latent_length(self, codes: list[torch.Tensor]) -> int:
        """The latent's time steps for these codes (each codebook's length times its stride)."""
        return int(codes[0].shape[-1]) * self.latent_rate

    def window_noise(self, latent_length: int, seed: int) -> list[torch.Tensor]:
        """One window's noise, ``[1, T_j]`` per noise block, float32, drawn as snac's
        ``decode`` draws it after ``torch.manual_seed(seed)``. Leaves the global RNG alone."""
        generator = torch.Generator().manual_seed(seed)
        return [
            torch.randn((1, 1, latent_length * rate), generator=generator)[0]
            for rate in self.noise_rates
        ]

    def forward(self, codes: list[torch.Tensor], noise: list[torch.Tensor]) -> torch.Tensor:
        """PCM ``[B, 1, samples]`` of ``B`` windows: ``codes[i]`` ``[B, T_i]``, ``noise[j]``
        ``[B, 1, T_j]``. Raises what torch raises for mismatched shapes."""
        return self._run(self._latent(codes), noise, 0)

    def _run(self, x: torch.Tensor, noise: list[torch.Tensor], start: int) -> torch.Tensor:
        # The wide late layers are memory-bound: a batch whose activation outgrows the budget
        # goes on in slices (measured: 4 windows as one [4, 16, 8192] batch cost more per
        # window than one at a time, the working set leaving the core's cache).
        noises = iter(noise[self._noise_index(start) :])
        for index in range(start, len(self.layers)):
            batch = x.shape[0]
            if batch > 1 and x.numel() > self.max_elements:
                step = max(1, self.max_elements * batch // x.numel())
                return torch.cat(
                    [
                        self._run(x[i : i + step], [n[i : i + step] for n in noise], index)
                        for i in range(0, batch, step)
                    ]
                )
            layer = self.layers[index]
            x = layer(x, next(noises).to(x.dtype)) if isinstance(layer, _Noise) else layer(x)
        return x

    def _noise_index(self, start: int) -> int:
        return sum(isinstance(layer, _Noise) for layer in self.layers[:start])

    def _latent(self, codes: list[torch.Tensor]) -> torch.Tensor:
        parts = [book(index) for book, index in zip(self.codebooks, codes, strict=True)]
        latent: torch.Tensor = parts[0]
        for part in parts[1:]:
            latent = latent + part
        return latent
