"""The 12 Hz speech tokenizer's encoder: 24 kHz reference audio -> codec frames ``[T, G]``.

Upstream's encoder *is* transformers' ``MimiModel`` (SEANet convolutions, a causal transformer,
a stride-2 downsampling to 12.5 Hz and a split residual quantizer) with its decoding half
removed; it keeps the first ``encoder_valid_num_quantizers`` codebooks and
``ceil(samples / 1920)`` frames. This module builds the same ``MimiModel`` from the checkpoint's
``encoder_config``, so its parameter names are upstream's (``encoder.*`` of the speech
tokenizer). It runs once per registered voice, never per request, so it is the one part of the
model that imports transformers (on first use); the module raises a clear error without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mstar_async.models.qwen3_tts.config import FRAME_SAMPLES

__all__ = ["SpeechEncoder", "upstream_name"]


def _mimi(config: Mapping[str, Any]) -> Any:
    try:
        from transformers import MimiConfig, MimiModel
    except ImportError as exc:  # pragma: no cover - transformers is in the test extra
        raise RuntimeError(
            "cloning voices with qwen3-tts needs transformers (its Mimi encoder is upstream's "
            "speech tokenizer encoder): pip install 'transformers>=4.45'"
        ) from exc
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    model: Any = MimiModel(MimiConfig(**kwargs))
    # Upstream drops the decoding half: its checkpoint has no such tensors. transformers 5
    # holds it in one sub-model (``decoder``); 4.x in three attributes.
    model.decoder = None
    if not hasattr(model.encoder, "encoder_seanet"):
        model.upsample = None
        model.decoder_transformer = None
    return model


#: transformers 5 nests Mimi's encoding half under ``encoder``; upstream's checkpoint has the
#: 4.x layout (``encoder``, ``encoder_transformer``, ``downsample`` at the top).
_V5_NAMES = (
    ("encoder.encoder_seanet.", "encoder."),
    ("encoder.encoder_transformer.", "encoder_transformer."),
    ("encoder.downsample.", "downsample."),
)


def upstream_name(name: str) -> str:
    """The upstream (speech tokenizer checkpoint) name of a ``SpeechEncoder`` parameter,
    without the checkpoint's ``encoder.`` prefix."""
    inner = name.removeprefix("encoder.")
    for ours, theirs in _V5_NAMES:
        if inner.startswith(ours):
            return theirs + inner[len(ours) :]
    return inner


class SpeechEncoder(nn.Module):
    """``MimiModel``'s encoding half under the attribute ``encoder`` (upstream's layout).

    Raises:
        RuntimeError: transformers is not installed.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.valid = int(config.get("_valid_quantizers", config.get("num_quantizers", 16)))
        self.encoder = _mimi(config)

    def encode(self, pcm: torch.Tensor) -> torch.Tensor:
        """One utterance of 24 kHz PCM ``[samples]`` -> codes ``[frames, valid quantizers]``
        (``frames = ceil(samples / 1920)``). Blocks (a forward).

        Raises:
            ValueError: not a non-empty 1-D tensor.
        """
        if pcm.dim() != 1 or not pcm.numel():
            raise ValueError(f"encode expects one utterance [samples], got {tuple(pcm.shape)}")
        param = next(self.parameters())
        with torch.inference_mode():
            out = self.encoder.encode(
                pcm.to(param.device, param.dtype)[None, None], return_dict=True
            )
        codes: torch.Tensor = out.audio_codes[0, : self.valid]
        frames = math.ceil(pcm.numel() / FRAME_SAMPLES)
        return codes[:, :frames].T.contiguous().cpu()
