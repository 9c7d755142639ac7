"""The thinker's text model: a Qwen3(-MoE) LM run by the paged ``KVCacheEngine``.

Upstream names (``thinker.`` prefix in a full checkpoint): ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``...q_norm`` / ``k_norm``, ``...mlp.gate`` +
``mlp.experts.{gate_up_proj,down_proj}`` on sparse layers (``mlp.{gate,up,down}_proj`` on dense
ones), ``model.norm``, ``lm_head``. The audio and vision towers are not part of it.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_async.models.llama import PagedAttention
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, Qwen3Stack

__all__ = ["Thinker"]


class Thinker(nn.Module):
    """Token ids in, normed hidden states out; ``compute_logits`` applies ``lm_head``."""

    def __init__(self, cfg: Qwen3Config, vocab: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Stack(cfg)
        self.model.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding table (the talker projects rows of it)."""
        table = self.model.embed_tokens
        assert isinstance(table, nn.Embedding)
        return table

    def forward(self, input_ids: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """Flat ``[n]`` ids -> ``[n, hidden]`` normed hidden states."""
        out: torch.Tensor = self.model(self.embed_tokens(input_ids), attention)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]``."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
