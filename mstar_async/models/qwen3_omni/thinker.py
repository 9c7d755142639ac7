"""The thinker's text model: a Qwen3(-MoE) LM run by the paged ``KVCacheEngine``.

Upstream names (``thinker.`` prefix in a full checkpoint): ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``...q_norm`` / ``k_norm``, ``...mlp.gate`` +
``mlp.experts.{gate_up_proj,down_proj}`` on sparse layers (``mlp.{gate,up,down}_proj`` on dense
ones), ``model.norm``, ``lm_head``. The audio and vision towers are not part of it: the audio
encoder runs as its own node, and its rows reach the thinker as prefill ``embeds`` that replace
the embeddings of the prompt's audio placeholder tokens (upstream's ``masked_scatter``).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_async.models.llama import PagedAttention
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, Qwen3Stack

__all__ = ["Thinker"]


class Thinker(nn.Module):
    """Token ids in, normed hidden states out; ``compute_logits`` applies ``lm_head``."""

    #: The paged engine may pass ``embeds`` (rows for some positions) to ``forward``.
    accepts_embeds = True

    def __init__(self, cfg: Qwen3Config, vocab: int, capture_layer: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Stack(cfg)
        self.model.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        # The talker reads the hidden state after this many layers at audio positions; a
        # forward with embeds keeps those rows until ``take_embeds_out``.
        self.capture_layer = capture_layer
        self._captured: torch.Tensor | None = None

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding table (its engine sends the talker rows of it)."""
        table = self.model.embed_tokens
        assert isinstance(table, nn.Embedding)
        return table

    def forward(
        self,
        input_ids: torch.Tensor,
        attention: PagedAttention,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Flat ``[n]`` ids -> ``[n, hidden]`` normed hidden states. ``embeds`` = ``(index
        [m], rows [m, hidden])`` replaces the embeddings at those flat positions (audio
        placeholders get the audio encoder's rows); positions stay the sequence's own, which
        is upstream's multimodal rotary position for audio (its three streams are equal there).

        Raises:
            ValueError: rows of another width than the hidden size.
        """
        x = self.embed_tokens(input_ids)
        if embeds is None:
            out: torch.Tensor = self.model(x, attention)
            return out
        index, rows = embeds
        if rows.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"embeds rows are {rows.shape[-1]} wide, the thinker's hidden size is {x.shape[-1]}"
            )
        x = x.index_copy(0, index, rows.to(x.dtype))
        # The stack's loop, keeping the rows' hidden state after ``capture_layer`` layers
        # (upstream's hidden_states[accept_hidden_layer]: after the norm for the last one).
        stack, capture = self.model, self.capture_layer
        cos, sin = stack.rotary(attention.positions, x.dtype)
        for i, layer in enumerate(stack.layers):
            if i == capture:
                self._captured = x[index]
            x = layer(x, cos, sin, attention)
        out = stack.norm(x)
        if capture == len(stack.layers):
            self._captured = out[index]
        return out

    def take_embeds_out(self) -> torch.Tensor | None:
        """The rows kept by the last forward with embeds (``[m, hidden]``, in ``index``
        order), once; None when none were kept."""
        captured, self._captured = self._captured, None
        return captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]``."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
