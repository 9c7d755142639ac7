"""The SNAC decoder as a streaming op: one window of Orpheus tokens in, the new frames' PCM out.

Windowing (``SlidingWindowChunkPolicy(28, 7)`` over the LM's tokens, each window 4 frames when
every token is a code): a window is decoded whole, so SNAC's non-causal convolutions see up
to three frames of left context, and the op emits only the audio of the frames *completed by
the window's new tokens* (``chunk.data[chunk.context:]``):

- the first window (context 0) emits all of its frames, samples ``[0, F * 2048)``;
- every later window emits its newest frame, the last 2048 samples of its decode;
- the tail that ``close()`` returns emits the frames its new tokens complete (none when the
  new tokens are only ``<end_of_speech>`` or a partial frame).

So every complete frame of the stream is heard exactly once, in order, and nothing waits for
a later window: ``frames * 2048`` samples in all. (Upstream Orpheus keeps samples
``[2048, 4096)`` of each window instead, i.e. a frame with two frames of look-ahead, and drops
the first frame and the last two; this runtime's window policy gives no final chunk when a
stream ends exactly on a window boundary, so holding audio back would lose it.)

SNAC's noise blocks draw random numbers; each window draws them from a generator seeded with
the window's stream position, so a window decodes to the same samples whenever it runs.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mstar_async.models.checkpoints import CheckpointError
from mstar_async.models.orpheus.vocab import OrpheusVocab, codebooks, parse_frames
from mstar_async.policies import Chunk, SlidingWindowChunkPolicy

WINDOW = 28
STRIDE = 7

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


class SnacWindowDecoder:
    """The codec op: ``codes`` (a list of ``Chunk`` of token ids) -> ``pcm`` (float32 tensors).

    Each chunk is decoded alone (see the module docstring for which samples it emits); a chunk
    that completes no new frame gives an empty tensor. Synchronous; never raises on odd tokens.
    """

    def __init__(self, snac: Any, vocab: OrpheusVocab) -> None:
        self.snac = snac
        self.vocab = vocab
        self.sample_rate = int(snac.sampling_rate)
        self.samples_per_frame = int(snac.hop_length) * int(snac.vq_strides[0])

    def decode_frames(self, frames: Sequence[Sequence[int]], seed: int) -> torch.Tensor:
        """PCM ``[len(frames) * samples_per_frame]`` of ``frames`` decoded together."""
        if not frames:
            return torch.zeros(0)
        with torch.inference_mode(), torch.random.fork_rng():
            torch.manual_seed(seed)
            audio: torch.Tensor = self.snac.decode(codebooks(frames))
        return audio.reshape(-1).float()

    def window_pcm(self, chunk: Chunk) -> torch.Tensor:
        """The PCM of the frames that ``chunk``'s new tokens complete, decoded with the rest of
        the window as context."""
        data = chunk.data
        tokens = data.reshape(-1).tolist() if isinstance(data, torch.Tensor) else list(data)
        frames, ends = parse_frames(tokens, self.vocab)
        fresh = sum(1 for end in ends if end >= chunk.context)
        if fresh == 0:
            return torch.zeros(0)
        pcm = self.decode_frames(frames, seed=chunk.start)
        return pcm[-fresh * self.samples_per_frame :].clone()

    def __call__(self, codes: list[Chunk]) -> dict[str, list[torch.Tensor]]:
        return {"pcm": [self.window_pcm(chunk) for chunk in codes]}


def decode_offline(tokens: Sequence[int], decoder: SnacWindowDecoder) -> torch.Tensor:
    """All of ``tokens``' audio at once, windowed exactly as the stream is: the reference the
    streamed PCM must equal."""
    policy = SlidingWindowChunkPolicy(WINDOW, STRIDE)
    chunks = policy.push(torch.tensor(list(tokens), dtype=torch.long)) + policy.close()
    parts = [decoder.window_pcm(chunk) for chunk in chunks]
    return torch.cat(parts) if parts else torch.zeros(0)
