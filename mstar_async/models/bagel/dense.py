"""Dense-concatenation CFG, the baseline that forked KV replaces.

Every guidance branch of every request is one row of a padded batch holding its *whole* context
(the prompt, and the input image's ViT tokens when editing) followed by the image's latent
tokens, and each denoising step runs that batch through the backbone from scratch: the prompt
is recomputed for every branch at every step. Attention within a row is what the paged path
computes: causal over text, bidirectional within an image's ViT tokens, and the latent tokens
see the whole context and each other. The understanding expert runs the context rows and the
generation expert the latent rows, layer by layer (a context token never attends to a latent
token, so running the context half of each layer first is exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mstar_async.errors import EngineError
from mstar_async.models.bagel.mot import BagelLM


@dataclass
class _Batch:
    rows: int
    length: int  # padded context length
    queries: int
    heads: int
    kv_heads: int
    head_dim: int


class _DenseAttention:
    """The ``PagedAttention`` seam over a padded dense batch: the context pass stores each
    layer's K/V, the latent pass attends over them and its own."""

    def __init__(self, batch: _Batch, positions: torch.Tensor, mask: torch.Tensor) -> None:
        self.batch = batch
        self.positions = positions
        self.mask = mask
        self.stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.context: _DenseAttention | None = None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b = self.batch
        n = q.shape[0] // b.rows
        qd = q.view(b.rows, n, b.heads, b.head_dim).transpose(1, 2)
        kd = k.view(b.rows, n, b.kv_heads, b.head_dim).transpose(1, 2)
        vd = v.view(b.rows, n, b.kv_heads, b.head_dim).transpose(1, 2)
        if self.context is None:
            self.stored[layer] = (kd, vd)
        elif b.length:
            ck, cv = self.context.stored[layer]
            kd, vd = torch.cat([ck, kd], dim=2), torch.cat([cv, vd], dim=2)
        out = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=self.mask, enable_gqa=b.heads != b.kv_heads
        )
        return out.transpose(1, 2).reshape(q.shape[0], b.heads, b.head_dim)


def dense_velocity(
    lm: BagelLM,
    tokens: Sequence[torch.Tensor],
    images: Sequence[torch.Tensor],
    latents: Sequence[torch.Tensor],
    ts: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """The velocity of every branch row: ``images[i]`` (ViT tokens, possibly none) then
    ``tokens[i]`` is row ``i``'s context, ``latents[i]`` at time ``ts[i]`` its queries.

    Raises:
        EngineError: the rows' latents differ in length.
    """
    n = latents[0].shape[0]
    if any(x.shape[0] != n for x in latents):
        raise EngineError("dense CFG batches images of one size only")
    und = lm.language_model
    cfg = und.config
    dtype, device = und.dtype, und.device
    lens = [int(m.shape[0]) + int(t.shape[0]) for m, t in zip(images, tokens, strict=True)]
    rows, length = len(lens), max(lens)
    batch = _Batch(rows, length, n, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    context = torch.zeros(rows, length, cfg.hidden_size, dtype=dtype, device=device)
    image_end = torch.zeros(rows, dtype=torch.long)
    for r, (image, ids) in enumerate(zip(images, tokens, strict=True)):
        m = image.shape[0]
        context[r, :m] = image.to(dtype)
        context[r, m : lens[r]] = und.model.embed_tokens(ids.to(device))
        image_end[r] = m
    lens_t = torch.tensor(lens)
    positions = torch.arange(length).repeat(rows)
    ctx_attn = _DenseAttention(
        batch, positions.to(device), _context_mask(lens_t, image_end, length)
    )
    q_positions = lens_t.repeat_interleave(n).to(device)
    q_mask = _query_mask(lens_t, length, n).to(dtype=dtype, device=device)
    q_attn = _DenseAttention(batch, q_positions, q_mask)
    q_attn.context = ctx_attn
    x_ctx = context.reshape(rows * length, -1)
    x_q = lm.embed_latents(latents, ts)
    cos_c, sin_c = und.rotary(ctx_attn.positions, dtype)
    cos_q, sin_q = und.rotary(q_positions, dtype)
    for und_layer, gen_layer in zip(und.model.layers, lm.gen.model.layers, strict=True):
        if length:
            x_ctx = und_layer(x_ctx, cos_c, sin_c, ctx_attn)
        x_q = gen_layer(x_q, cos_q, sin_q, q_attn)
    velocity = lm.llm2vae(lm.gen.model.norm(x_q))
    return list(velocity.view(rows, n, -1).to(latents[0].dtype))


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask.unsqueeze(1)


def _context_mask(lens: torch.Tensor, image_end: torch.Tensor, length: int) -> torch.Tensor:
    i = torch.arange(length).view(1, -1, 1)
    j = torch.arange(length).view(1, 1, -1)
    end = image_end.view(-1, 1, 1)
    in_image = (i < end) & (j < end)
    allowed = ((j <= i) | in_image) & (j < lens.view(-1, 1, 1))
    # Padding rows see their first key only, so no row is all -inf.
    allowed = allowed | ((i >= lens.view(-1, 1, 1)) & (j == 0))
    return _additive(allowed)


def _query_mask(lens: torch.Tensor, length: int, n: int) -> torch.Tensor:
    j = torch.arange(length + n).view(1, 1, -1)
    allowed = (j < lens.view(-1, 1, 1)) | (j >= length)
    return _additive(allowed.expand(-1, n, -1))


def dense_op(lm: BagelLM) -> Any:
    """The ``StatelessEngine`` op: per-step ``tokens``, ``image`` (ViT tokens, ``[0, hidden]``
    for none), ``latent`` and ``t`` -> ``velocity``."""

    def velocity(tokens: Any, image: Any, latent: Any, t: Any) -> dict[str, list[torch.Tensor]]:
        return {"velocity": dense_velocity(lm, list(tokens), list(image), list(latent), list(t))}

    return velocity
