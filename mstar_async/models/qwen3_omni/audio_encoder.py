"""The audio encoder (speech in): log-mel frames -> rows in the thinker's hidden size.

Architecture of transformers' ``Qwen3OmniMoeAudioEncoder`` (the checkpoint's
``thinker.audio_tower.*``, same parameter names):

- The mel frames of an utterance are cut into *chunks* of ``2 * n_window`` frames (100: one
  second), the last one shorter. Each chunk goes alone through three ``Conv2d(3, stride 2,
  padding 1)`` + GELU layers over (mel, time), so 100 frames become 13 *tokens*; ``conv_out``
  flattens channels x mel bins into ``d_model``, and sinusoidal positions restart at 0 in every
  chunk.
- A pre-LayerNorm transformer (biased q/k/v/out projections, GELU MLP) attends, without a causal
  mask, within *windows* of ``n_window_infer // (2 * n_window)`` consecutive chunks of one
  utterance (8 chunks, 104 tokens, for the released 800), the last window shorter.
- ``ln_post``, ``proj1``, GELU, ``proj2`` project to ``output_dim``, the thinker's hidden size.

Work decomposes by chunk (convolutions) and by window (attention), which is what lets
:mod:`~mstar_async.models.qwen3_omni.audio_stream` encode an utterance while it is spoken.

Upstream zero-pads every chunk of a batch to the longest chunk of the batch, and the padding
changes the last token of a chunk shorter than that (its convolutions read the GELU of padded
columns). A real batch holds a full chunk, so every tail is padded to ``2 * n_window``. Here a
chunk is convolved as if padded to its *span*, ``min(2 * n_window, utterance frames)``:
upstream's result for the utterance on its own, whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.models.qwen3_omni.decoder import seeded_init

__all__ = [
    "AudioEncoder",
    "AudioEncoderConfig",
    "audio_tower_state",
    "conv_length",
    "seeded_audio_encoder",
]

# The released files keep the tower under the first prefix; transformers 5's in-memory model
# (and so its state_dict) under the second. Names below either are this module's.
_PREFIXES = ("thinker.audio_tower.", "thinker.model.audio_tower.")


def audio_tower_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The audio tower's entries of a whole model's state dict, named as :class:`AudioEncoder`'s
    parameters (``thinker.audio_tower.`` or ``thinker.model.audio_tower.`` stripped); an empty
    dict if it has none. Pure; raises nothing (to load them strictly:
    ``load_upstream(empty_module(lambda: AudioEncoder(cfg)), StateDictSource(...), "")``)."""
    return {
        key[len(prefix) :]: value
        for key, value in state.items()
        for prefix in _PREFIXES
        if key.startswith(prefix)
    }


def conv_length(frames: int) -> int:
    """Tokens the three stride-2 convolutions make from a chunk of ``frames`` mel frames (0 for
    0). Pure; raises nothing."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


@dataclass(frozen=True)
class AudioEncoderConfig:
    """Sizes of the audio encoder (upstream ``Qwen3OmniMoeAudioEncoderConfig`` field names)."""

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    max_source_positions: int = 1500
    n_window: int = 50
    output_dim: int = 3584
    n_window_infer: int = 800
    conv_chunksize: int = 500
    downsample_hidden_size: int = 480

    def __post_init__(self) -> None:
        """Raises ValueError: heads that do not divide ``d_model``, an odd ``d_model`` (the
        sinusoids come in sin/cos pairs), or an attention window shorter than one chunk."""
        if self.d_model % self.encoder_attention_heads or self.d_model % 2:
            raise ValueError(
                f"d_model {self.d_model} must be even and a multiple of "
                f"{self.encoder_attention_heads} heads"
            )
        if self.n_window_infer < self.chunk_frames:
            raise ValueError(
                f"n_window_infer {self.n_window_infer} is shorter than one chunk "
                f"({self.chunk_frames} frames)"
            )
        if self.chunk_tokens > self.max_source_positions:
            raise ValueError(
                f"a chunk makes {self.chunk_tokens} tokens, more than max_source_positions "
                f"{self.max_source_positions}"
            )

    @property
    def chunk_frames(self) -> int:
        """Mel frames per chunk (``2 * n_window``)."""
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Tokens a full chunk makes."""
        return conv_length(self.chunk_frames)

    @property
    def window_chunks(self) -> int:
        """Chunks per attention window (upstream rounds ``n_window_infer`` down to chunks)."""
        return self.n_window_infer // self.chunk_frames

    @property
    def conv_bins(self) -> int:
        """Mel bins left after the three stride-2 convolutions."""
        return conv_length(self.num_mel_bins)

    def output_length(self, frames: int) -> int:
        """Tokens (thinker rows) an utterance of ``frames`` mel frames encodes to; upstream's
        ``_get_feat_extract_output_lengths``, which assumes 100-frame chunks (13 tokens).
        Pure; raises nothing."""
        full, tail = divmod(frames, self.chunk_frames)
        return full * self.chunk_tokens + conv_length(tail)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> AudioEncoderConfig:
        """Read upstream's ``audio_config`` dict (absent keys keep upstream defaults).

        Raises:
            ValueError: an activation other than GELU, or sizes ``__post_init__`` rejects.
        """
        activation = config.get("activation_function", "gelu")
        if activation != "gelu":
            raise ValueError(f"the audio encoder supports GELU only, got {activation!r}")
        return cls(**{k: int(v) for k, v in config.items() if k in cls.__dataclass_fields__})


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    # Computed in float32 in upstream's order so the table matches its buffer bit for bit; on
    # the CPU explicitly, so a module built on the meta device (to be loaded) still has it.
    increment = math.log(10_000) / (channels // 2 - 1)
    steps = torch.arange(channels // 2, dtype=torch.float32, device="cpu")
    inv_timescales = torch.exp(-increment * steps)
    scaled = (
        torch.arange(length, dtype=torch.float32, device="cpu")[:, None] * inv_timescales[None, :]
    )
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class _Attention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.heads = cfg.encoder_attention_heads
        dim = cfg.d_model
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``x`` [windows, rows, dim]; ``keys`` [windows, 1, 1, rows] marks real rows."""
        windows, rows, dim = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:
            out: torch.Tensor = proj(x).view(windows, rows, self.heads, -1).transpose(1, 2)
            return out

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), attn_mask=keys
        )
        result: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(windows, rows, dim))
        return result


class _Layer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), keys)
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        return out


class AudioEncoder(nn.Module):
    """Mel frames -> thinker rows; submodule names are upstream's (``thinker.audio_tower.*``).

    Three entry points, all batched over requests: :meth:`forward` encodes whole utterances;
    :meth:`embed_chunks` (convolutions) and :meth:`attend` (transformer and projection) are its
    two halves, which the streaming encoder calls as chunks and windows complete. All are
    synchronous, CPU/GPU-bound torch calls with no cancellation point; they change no state.
    """

    positions: torch.Tensor

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        width = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, width, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(width, width, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(width, width, 3, 2, padding=1)
        self.conv_out = nn.Linear(width * cfg.conv_bins, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        # Upstream's table is a non-persistent buffer too: checkpoints do not carry it.
        self.register_buffer(
            "positions", _sinusoids(cfg.chunk_tokens, cfg.d_model), persistent=False
        )

    def embed_chunks(
        self, chunks: Sequence[torch.Tensor], spans: Sequence[int]
    ) -> list[torch.Tensor]:
        """Convolve chunks ``[num_mel_bins, frames]`` (frames <= ``2 * n_window``) as if each
        were zero-padded to its span, and add positions: ``[conv_length(frames), d_model]``
        each.

        Raises:
            ValueError: a chunk of the wrong height, empty, or longer than its span or than
                ``2 * n_window``.
        """
        cfg = self.config
        for chunk, span in zip(chunks, spans, strict=True):
            if chunk.dim() != 2 or chunk.shape[0] != cfg.num_mel_bins:
                raise ValueError(
                    f"a chunk must be [{cfg.num_mel_bins}, frames], got {tuple(chunk.shape)}"
                )
            if not 0 < chunk.shape[1] <= span <= cfg.chunk_frames:
                raise ValueError(
                    f"a chunk of {chunk.shape[1]} frames with span {span} "
                    f"(at most {cfg.chunk_frames})"
                )
        if not chunks:
            return []
        width = max(spans)
        weight = self.conv2d1.weight
        batch = torch.stack([F.pad(c.to(weight), (0, width - c.shape[1])) for c in chunks])
        widths = torch.tensor(spans, device=weight.device)[:, None]
        # Pieces of conv_chunksize chunks bound the activations' memory, as upstream's do.
        pieces = [
            self._convolve(part, part_spans)
            for part, part_spans in zip(
                torch.split(batch, cfg.conv_chunksize),
                torch.split(widths, cfg.conv_chunksize),
                strict=True,
            )
        ]
        conv = torch.cat(pieces)
        rows, channels, bins, tokens = conv.shape
        embedded = self.conv_out(conv.permute(0, 3, 1, 2).reshape(rows, tokens, channels * bins))
        embedded = embedded + self.positions[:tokens].to(embedded)
        return [row[: conv_length(c.shape[1])] for row, c in zip(embedded, chunks, strict=True)]

    def _convolve(self, batch: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        """``[n, bins, width]`` -> ``[n, channels, bins', tokens]``; columns past what a span of
        input makes are zeroed after each layer, as the next convolution's own zero padding
        would be had the chunk been that long."""
        x = batch[:, None]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            span = (span - 1) // 2 + 1
            keep = torch.arange(x.shape[-1], device=x.device)[None, :] < span
            x = x * keep[:, None, None, :].to(x)
        return x

    def attend(self, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the transformer within each window ``[tokens, d_model]`` (tokens of one
        utterance, at most one attention window's worth) and project: ``[tokens, output_dim]``.

        Raises:
            ValueError: a window that is empty or of the wrong width.
        """
        cfg = self.config
        for window in windows:
            if window.dim() != 2 or window.shape[1] != cfg.d_model or window.shape[0] == 0:
                raise ValueError(
                    f"a window must be [tokens > 0, {cfg.d_model}], got {tuple(window.shape)}"
                )
        if not windows:
            return []
        lengths = [w.shape[0] for w in windows]
        x = nn.utils.rnn.pad_sequence(list(windows), batch_first=True)
        real = (
            torch.arange(x.shape[1], device=x.device)[None, :]
            < torch.tensor(lengths, device=x.device)[:, None]
        )
        keys = real[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keys)
        out = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return [row[:length] for row, length in zip(out, lengths, strict=True)]

    def forward(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode whole utterances ``[num_mel_bins, frames]`` in one batch: ``[output_length
        (frames), output_dim]`` each.

        Raises:
            ValueError: an utterance of the wrong height or without frames.
        """
        cfg = self.config
        chunks: list[torch.Tensor] = []
        spans: list[int] = []
        counts: list[int] = []
        for mel in features:
            if mel.dim() != 2 or mel.shape[1] == 0:
                raise ValueError(f"an utterance must be [bins, frames > 0], got {tuple(mel.shape)}")
            pieces = torch.split(mel, cfg.chunk_frames, dim=1)
            chunks += pieces
            spans += [min(cfg.chunk_frames, mel.shape[1])] * len(pieces)
            counts.append(len(pieces))
        embedded = iter(self.embed_chunks(chunks, spans))
        windows: list[torch.Tensor] = []
        per_utterance: list[int] = []
        for count in counts:
            mine = [next(embedded) for _ in range(count)]
            starts = range(0, count, cfg.window_chunks)
            windows += [torch.cat(mine[s : s + cfg.window_chunks]) for s in starts]
            per_utterance.append(len(starts))
        attended = iter(self.attend(windows))
        return [torch.cat([next(attended) for _ in range(n)]) for n in per_utterance]


def seeded_audio_encoder(cfg: AudioEncoderConfig, seed: int) -> AudioEncoder:
    """An encoder with seeded random weights (``seeded_init``'s scales), in eval mode, on the
    CPU in float32. Deterministic for ``(cfg, seed)``; leaves the global RNG alone; raises
    nothing beyond the config's own checks.

    ``ln_post`` keeps LayerNorm's identity init: ``seeded_init`` knows norms by a
    ``norm.weight`` suffix, which upstream's name for it lacks.
    """
    encoder = AudioEncoder(cfg)
    seeded_init(encoder, seed, skip=("ln_post",))
    return encoder.eval()
