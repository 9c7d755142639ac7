"""The SNAC decoder as a streaming op: a window of Orpheus tokens in, its new frame's PCM out.

SNAC's convolutions are not causal: a frame's audio depends on the frames on both sides of it.
Upstream Orpheus (``orpheus_tts``' decoder) therefore decodes each window of the last 28 codes
(4 frames), every 7 codes, and keeps samples ``[2048, 4096)``: the second frame, with one frame
of left context and two frames of look-ahead. It never emits the first frame (no window has it
second) or the last two (no window follows them).

This op decodes every frame that way, those three included with whatever context exists. The
edge's policy is ``LeftContextChunkPolicy(7, 7, 14)`` over the LM's tokens (``snac_policy``):
each chunk's new tokens are one frame, after one frame of left context and before two of
look-ahead, so chunks ``1 .. F-3`` are exactly upstream's windows; chunk 0 is frames 0..2 (no
left context), and the final chunks that ``close()`` returns carry the last two frames with
what follows them. The op decodes every frame the window holds and emits the audio of the
frames whose last code lies in the chunk's new tokens:

- frame ``j`` comes from chunk ``j``: ``samples_per_frame`` samples (2048 at 24 kHz), so a
  stream of ``F`` complete frames gives ``F * 2048`` samples, each frame once, in order;
- a chunk whose new tokens complete no frame (``<end_of_speech>``, the codes of an unfinished
  last frame, the final chunk with no new items) gives an empty tensor.

The price of look-ahead is latency: a frame's audio waits for two more frames of codes, so the
first audio comes after 21 codes (3 frames). A token that is not a code shifts the 7-token grid
(upstream counts codes only); frames near it then see less context, and each is still heard
once.

SNAC's noise blocks draw random numbers; each window draws them from a generator seeded with
the window's stream position, so a window decodes to the same samples whenever it runs.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar_async.models.checkpoints import CheckpointError
from mstar_async.models.orpheus.snac_kernels import SnacKernels
from mstar_async.models.orpheus.vocab import CODES_PER_FRAME, OrpheusVocab, codebooks, parse_frames
from mstar_async.policies import Chunk, LeftContextChunkPolicy

LEFT_FRAMES = 1
"""Frames of left context each frame is decoded with (upstream's window keeps its second frame)."""

AHEAD_FRAMES = 2
"""Frames of look-ahead each frame is decoded with (the two after it in upstream's window)."""


def snac_policy() -> LeftContextChunkPolicy:
    """The token stream's policy into SNAC: one frame of new codes, ``LEFT_FRAMES`` before it and
    ``AHEAD_FRAMES`` after it. Pure; never raises."""
    return LeftContextChunkPolicy(
        CODES_PER_FRAME, LEFT_FRAMES * CODES_PER_FRAME, AHEAD_FRAMES * CODES_PER_FRAME
    )


SNAC_24KHZ: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
"""``hubertsiuzdak/snac_24khz``'s config.json (19.8 M parameters): the codec Orpheus uses."""

SNAC_TINY: dict[str, Any] = {**SNAC_24KHZ, "encoder_dim": 8, "decoder_dim": 64}
"""The same rates and codebooks with narrow convolutions: 24 kHz, 2048 samples per frame."""

SNAC_SMALL: dict[str, Any] = {**SNAC_24KHZ, "encoder_dim": 16, "decoder_dim": 256}
"""A quarter of the 24 kHz decoder's width: about 1/10 of its compute per window, so a few
streams stay near real time on two cores (the full config costs ~0.45 s per 85 ms window
there)."""


def _snac_class() -> Any:
    # snac compiles its activation with torch.jit.script at import, which recent torch
    # deprecates with a warning; the codec works the same, so that one warning is silenced.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*torch.jit.script.*", category=DeprecationWarning
        )
        from snac import SNAC
    return SNAC


def build_snac(config: dict[str, Any], seed: int) -> Any:
    """``snac.SNAC(**config)`` with weights drawn from ``seed`` (the global RNG is untouched).

    Raises:
        TypeError: ``config`` names an argument SNAC does not take.
    """
    snac = _snac_class()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return snac(**config).eval()


def check_snac_folder(folder: str | Path) -> tuple[Path, Path]:
    """The config and weights files of the SNAC folder ``folder`` (snac's names), checked to
    exist without reading them.

    Raises:
        CheckpointError: a file is missing.
    """
    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / "pytorch_model.bin"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: a SNAC folder holds config.json and pytorch_model.bin "
                "(as in hubertsiuzdak/snac_24khz)"
            )
    return config_path, weights_path


def load_snac(folder: str | Path) -> Any:
    """SNAC from a local folder holding ``config.json`` and ``pytorch_model.bin`` (snac's names).

    Raises:
        CheckpointError: a file is missing or unreadable, or the weights do not fit the config.
    """
    snac = _snac_class()
    config_path, weights_path = check_snac_folder(folder)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        model = snac(**config)
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load SNAC from {folder}: {exc}") from exc
    return model.eval()


@dataclass(frozen=True)
class _Window:
    """One chunk's decode: its frames, the noise seed, and which samples it keeps."""

    frames: list[list[int]]
    seed: int
    keep: slice


class SnacWindowDecoder:
    """The codec op: ``codes`` (a list of ``Chunk`` of token ids) -> ``pcm`` (float32 tensors).

    Each chunk emits the audio of its new frames decoded with its whole window (see the module
    docstring); a chunk that completes no new frame gives an empty tensor. The windows of one
    call are decoded by ``SnacKernels``, those with the same number of frames (every window
    of a stream in full flow has 4) in one batched forward, so several streams' windows share
    one pass. A window's samples do not depend on what it is batched with.

    ``dtype`` is the codec's compute dtype: float32 (default; within 1e-5 of snac's own
    ``decode``) or bfloat16 (within 3e-2, measured 1.1e-2; docs/speech.md says why float32).
    ``snac`` stays the reference module; its weights are copied at construction. Synchronous;
    never raises on odd tokens.

    Raises:
        ValueError (construction): ``snac`` is not a ``snac.SNAC``.
    """

    def __init__(self, snac: Any, vocab: OrpheusVocab, dtype: torch.dtype = torch.float32) -> None:
        self.snac = snac
        self.vocab = vocab
        self.kernels = SnacKernels(snac).to(dtype)
        self.sample_rate = int(snac.sampling_rate)
        self.samples_per_frame = int(snac.hop_length) * int(snac.vq_strides[0])

    def decode_frames(self, frames: Sequence[Sequence[int]], seed: int) -> torch.Tensor:
        """PCM ``[len(frames) * samples_per_frame]`` of ``frames`` decoded together, SNAC's noise
        drawn from ``seed``."""
        if not frames:
            return torch.zeros(0)
        return self.decode_batch([frames], [seed])[0]

    def decode_batch(
        self, windows: Sequence[Sequence[Sequence[int]]], seeds: Sequence[int]
    ) -> list[torch.Tensor]:
        """PCM of each window of frames (all of the same, non-zero length), decoded in one
        forward, each with its noise drawn from its seed.

        Raises:
            ValueError: the windows differ in length or are empty.
        """
        if len({len(w) for w in windows}) != 1 or not windows[0]:
            raise ValueError("decode_batch needs non-empty windows of one length")
        books = [codebooks(w) for w in windows]
        codes = [torch.cat(book) for book in zip(*books, strict=True)]
        latent = self.kernels.latent_length(codes)
        noises = [self.kernels.window_noise(latent, seed) for seed in seeds]
        noise = [torch.stack(block) for block in zip(*noises, strict=True)]
        with torch.inference_mode():
            audio = self.kernels(codes, noise)
        return list(audio.float().reshape(len(windows), -1))

    def window_pcm(self, chunk: Chunk) -> torch.Tensor:
        """The PCM of the frames that ``chunk``'s new tokens complete, decoded with the frames
        on both sides of them in the window as context."""
        return self.windows_pcm([chunk])[0]

    def windows_pcm(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """``window_pcm`` of each chunk; windows of the same length decode as one batch."""
        plans = [self._plan(chunk) for chunk in chunks]
        out = [torch.zeros(0) for _ in chunks]
        groups: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            if plan is not None:
                groups.setdefault(len(plan.frames), []).append(i)
        for members in groups.values():
            windows = [plan for i in members if (plan := plans[i]) is not None]
            pcms = self.decode_batch([w.frames for w in windows], [w.seed for w in windows])
            for i, window, pcm in zip(members, windows, pcms, strict=True):
                out[i] = pcm[window.keep].clone()
        return out

    def _plan(self, chunk: Chunk) -> _Window | None:
        data = chunk.data
        tokens = data.reshape(-1).tolist() if isinstance(data, torch.Tensor) else list(data)
        frames, ends = parse_frames(tokens, self.vocab)
        stop = len(tokens) - chunk.lookahead
        fresh = [i for i, end in enumerate(ends) if chunk.context <= end < stop]
        if not fresh:
            return None
        size = self.samples_per_frame
        return _Window(frames, chunk.start, slice(fresh[0] * size, (fresh[-1] + 1) * size))

    def __call__(self, codes: list[Chunk]) -> dict[str, list[torch.Tensor]]:
        return {"pcm": self.windows_pcm(codes)}


def decode_offline(tokens: Sequence[int], decoder: SnacWindowDecoder) -> torch.Tensor:
    """All of ``tokens``' audio at once, windowed exactly as the stream is: the reference the
    streamed PCM must equal."""
    policy = snac_policy()
    chunks = policy.push(torch.tensor(list(tokens), dtype=torch.long)) + policy.close()
    parts = decoder.windows_pcm(chunks)
    return torch.cat(parts) if parts else torch.zeros(0)
