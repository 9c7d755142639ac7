"""Typed outputs as JSON events of the native ``/generate`` route.

    TextDelta    {"type": "text", "text": ...}
    TextEnd      {"type": "text_end", "prompt_tokens", "completion_tokens", "finish_reason"}
    AudioChunk   {"type": "audio", "sample_rate", "segment", "samples", "format": "s16le",
                  "data": base64 of little-endian int16 PCM}
    ImageOutput  {"type": "image", "shape": [c, h, w], "format": "png", "data": base64 PNG}
    LatentOutput {"type": "latent", "step", "shape", "data": nested lists}
    ActionOutput {"type": "action", "shape", "data": nested lists}

A new output type needs one more encoder in ``ENCODERS``.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable
from typing import Any

import torch

from mstar_async.outputs import (
    ActionOutput,
    AudioChunk,
    ImageOutput,
    LatentOutput,
    TextDelta,
    TextEnd,
)


def pcm_s16le(pcm: torch.Tensor) -> bytes:
    """Float PCM in [-1, 1] as little-endian signed 16-bit samples (clipped)."""
    samples = (pcm.detach().float().flatten().clamp(-1, 1) * 32767).round().to(torch.int16)
    return samples.numpy().astype("<i2").tobytes()


def png(image: torch.Tensor) -> bytes:
    """A PNG of a [channels, height, width] image in [0, 1] (1, 3 or 4 channels).

    Raises:
        ValueError: the tensor is not [1|3|4, H, W].
    """
    if image.dim() != 3 or image.shape[0] not in (1, 3, 4):
        raise ValueError(f"a PNG needs a [1|3|4, H, W] image, got shape {list(image.shape)}")
    channels, height, width = image.shape
    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    rows = pixels.permute(1, 2, 0).reshape(height, width * channels).numpy()
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 on each row
    color = {1: 0, 3: 2, 4: 6}[int(channels)]
    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _audio(item: AudioChunk) -> dict[str, Any]:
    return {
        "type": "audio",
        "sample_rate": item.sample_rate,
        "segment": item.segment,
        "samples": item.pcm.numel(),
        "format": "s16le",
        "data": _b64(pcm_s16le(item.pcm)),
    }


def _image(item: ImageOutput) -> dict[str, Any]:
    return {
        "type": "image",
        "shape": list(item.image.shape),
        "format": "png",
        "data": _b64(png(item.image)),
    }


ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    TextDelta: lambda item: {"type": "text", "text": item.text},
    TextEnd: lambda item: {
        "type": "text_end",
        "prompt_tokens": item.prompt_tokens,
        "completion_tokens": item.completion_tokens,
        "finish_reason": item.finish_reason,
    },
    AudioChunk: _audio,
    ImageOutput: _image,
    LatentOutput: lambda item: {
        "type": "latent",
        "step": item.step,
        "shape": list(item.latent.shape),
        "data": item.latent.detach().float().tolist(),
    },
    ActionOutput: lambda item: {
        "type": "action",
        "shape": list(item.actions.shape),
        "data": item.actions.detach().float().tolist(),
    },
}


def encode_output(item: Any) -> dict[str, Any]:
    """``item`` as a JSON-ready event.

    Raises:
        TypeError: the output type has no encoder (add one to ``ENCODERS``).
    """
    encoder = ENCODERS.get(type(item))
    if encoder is None:
        raise TypeError(f"no HTTP encoding for output type {type(item).__name__}")
    return encoder(item)
