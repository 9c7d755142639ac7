"""The language backbone: a Qwen2 decoder for text and ViT tokens, a second set of layer weights
for image latent tokens (BAGEL's mixture-of-transformers "generation expert"), and the heads
that move latents in and out of it.

Both experts attend jointly: an image's latent tokens run the generation layers, and each of
their layers attends over the prompt's K/V that the understanding layers of the same index
wrote. So a prefill goes through the understanding expert (``forward``, the ``PagedModel``
seam), and the latent tokens of a denoising step through the generation expert
(``forward_queries`` with ``op="attend"``, the ``QueryModel`` seam of the KV engine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.errors import EngineError
from mstar_async.models.bagel.config import BagelConfig
from mstar_async.models.llama import PagedAttention, PagedDecoder


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings, ``[grid * grid, dim]`` (row-major), half the
    channels for the row and half for the column, as BAGEL's latent and ViT position tables."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / max(quarter, 1))
    pos = torch.arange(grid, dtype=torch.float32)
    rows, cols = torch.meshgrid(pos, pos, indexing="ij")

    def embed(p: torch.Tensor) -> torch.Tensor:
        angles = p.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    table = torch.cat([embed(rows), embed(cols)], dim=1)
    return F.pad(table, (0, dim - table.shape[1]))


class TimestepEmbedder(nn.Module):
    """``t`` in [0, 1] -> a hidden-size vector: sinusoidal features, then a two-layer MLP (DiT)."""

    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(
            nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = (t.float().reshape(-1, 1) * 1000) * freqs.to(t.device)
        features = torch.cat([args.cos(), args.sin()], dim=-1)
        features = features.to(next(self.mlp.parameters()).dtype)
        out: torch.Tensor = self.mlp(features)
        return out


class BagelLM(nn.Module):
    """The mixture-of-transformers backbone over the paged KV cache.

    ``language_model`` is a ``PagedDecoder`` with Qwen2's parameter names (the understanding
    expert, embeddings and LM head); ``gen`` holds the generation expert's layers and final norm
    (upstream's ``*_moe_gen`` weights) in the same layout. ``vae2llm`` / ``llm2vae``,
    ``time_embedder`` and ``latent_pos_embed`` are named as upstream.
    """

    latent_pos_embed: torch.Tensor

    def __init__(self, cfg: BagelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        """Build with weights seeded from ``cfg.seed``, without touching the global RNG."""
        super().__init__()
        self.cfg = cfg
        dec = cfg.decoder()
        self.language_model = PagedDecoder.random(dec, cfg.seed, dtype=dtype)
        # Only the layers and the final norm of this decoder are used; a one-entry vocabulary
        # keeps its unused embedding and head negligible.
        self.gen = PagedDecoder.random(
            replace(dec, vocab_size=1, tie_word_embeddings=True), cfg.seed + 1, dtype=dtype
        )
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed + 2)
            self.vae2llm = nn.Linear(cfg.token_dim, cfg.hidden)
            self.llm2vae = nn.Linear(cfg.hidden, cfg.token_dim)
            self.time_embedder = TimestepEmbedder(cfg.hidden)
        self.register_buffer("latent_pos_embed", sincos_2d(cfg.hidden, cfg.grid), persistent=False)
        self.to(dtype)
        self.eval()

    # ------------------------------------------------------------------ PagedModel

    def forward(self, input_ids: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """Text tokens through the understanding expert (the KV engine's prefill and decode)."""
        out: torch.Tensor = self.language_model(input_ids, attention)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The understanding expert's LM head."""
        return self.language_model.compute_logits(hidden)

    # ------------------------------------------------------------------ QueryModel

    def query_length(self, inputs: Mapping[str, Any]) -> int:
        """Tokens one ``extend`` (``embeds``: ViT tokens) or ``attend`` (``latent``) step adds.

        Raises:
            EngineError: the step has neither input.
        """
        for name in ("embeds", "latent"):
            if name in inputs:
                return int(inputs[name].shape[0])
        raise EngineError(
            "bagel query steps take embeds=[n, hidden] (extend) or latent=[n, token_dim] and "
            f"t (attend); got inputs {sorted(inputs)}"
        )

    def forward_queries(
        self, op: str, inputs: Sequence[Mapping[str, Any]], attention: Any
    ) -> list[dict[str, Any]]:
        """``extend``: ViT tokens through the understanding expert, kept in the cache.
        ``attend``: noisy latents at time ``t`` through the generation expert -> velocity.

        Raises:
            EngineError: an op other than these two, or inputs that do not match it.
        """
        lengths = [self.query_length(x) for x in inputs]
        if op == "extend":
            x = torch.cat([x["embeds"] for x in inputs]).to(self.language_model.dtype)
            self._layers(self.language_model, x, attention.positions, attention)
            return [{"length": torch.tensor(n)} for n in lengths]
        if op != "attend":
            raise EngineError(f"bagel has no query op {op!r}; ops: extend, attend")
        x = self.embed_latents([x["latent"] for x in inputs], [x["t"] for x in inputs])
        # Every latent token of an image shares one rotary position, the one after the prefix
        # (upstream's packed position ids); 2-D placement comes from latent_pos_embed.
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).to(attention.positions.device)
        positions = attention.positions[starts].repeat_interleave(
            torch.tensor(lengths, device=starts.device)
        )
        hidden = self._layers(self.gen, x, positions, attention)
        velocity = self.llm2vae(hidden)
        return [{"velocity": v} for v in velocity.split(lengths)]

    # ------------------------------------------------------------------ pieces

    def embed_latents(
        self, latents: Sequence[torch.Tensor], ts: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Noisy latent tokens -> hidden: ``vae2llm(x) + time_embedder(t) + latent_pos_embed``."""
        dtype = self.vae2llm.weight.dtype
        parts = []
        for latent, t in zip(latents, ts, strict=True):
            n = latent.shape[0]
            x = self.vae2llm(latent.to(dtype))
            parts.append(x + self.time_embedder(t.reshape(1)) + self.latent_pos_embed[:n])
        return torch.cat(parts)

    def _layers(
        self, expert: PagedDecoder, x: torch.Tensor, positions: torch.Tensor, attention: Any
    ) -> torch.Tensor:
        cos, sin = self.language_model.rotary(positions, x.dtype)
        for layer in expert.model.layers:
            x = layer(x, cos, sin, attention)
        out: torch.Tensor = expert.model.norm(x)
        return out
