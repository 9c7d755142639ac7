"""The thinker's engine: the paged ``KVCacheEngine``, whose token steps also hand the talker the
thinker's input embedding rows it projects.

Upstream's talker reads the thinker's ``hidden_states[0]``, its input embeddings: of the prompt
and of each token the thinker feeds itself, and of ``tts_bos`` / ``tts_eos`` / ``tts_pad`` from
the thinker's table. Here the thinker's rank gathers those rows from its own table (the values
its forward embeds, bit for bit) and sends them on the edges that carry its tokens, so a rank
holding only the talker reads none of the thinker's weights. Besides its ``KVCacheEngine``
outputs:

- ``prefill`` -> ``row`` (``[hidden]``: the sampled token's row), ``rows`` (the rows at the
  prompt positions the talker projects, ``talker.prompt_layout(...).text``; None for a prompt
  without an assistant header, which the talker refuses), ``tts`` (``[3, hidden]``: the rows of
  ``tts_bos``, ``tts_eos``, ``tts_pad``);
- ``decode`` -> ``row``, the sampled token's row.

The talker needs only the user turns' text and the assistant header, so a long system prompt or
a spoken turn's audio placeholders cost nothing to send.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_async.engines.base import Step, StepResult
from mstar_async.engines.kv import AttentionSpec
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.models.qwen3_omni.talker import TalkerTokens, prompt_layout
from mstar_async.models.qwen3_omni.thinker import Thinker

__all__ = ["ThinkerEngine", "talker_rows", "tts_rows"]

_ROW_OPS = ("prefill", "decode")


def talker_rows(
    table: torch.Tensor, prompt: torch.Tensor | Sequence[int], tokens: TalkerTokens
) -> torch.Tensor | None:
    """The rows of embedding ``table`` at the prompt positions the talker projects
    (``prompt_layout(...).text``, in order) for a prompt of ids; None when the prompt has no
    assistant header."""
    ids = [int(t) for t in torch.as_tensor(prompt).reshape(-1).tolist()]
    layout = prompt_layout(ids, tokens)
    if layout is None:
        return None
    at = torch.tensor([ids[p] for p in layout.text], dtype=torch.long, device=table.device)
    return table[at]


def tts_rows(table: torch.Tensor, tokens: TalkerTokens) -> torch.Tensor:
    """The rows of ``tts_bos``, ``tts_eos`` and ``tts_pad`` in embedding ``table``
    (``[3, hidden]``, in ``talker.TTS_*`` order)."""
    ids = [tokens.tts_bos, tokens.tts_eos, tokens.tts_pad]
    return table[torch.tensor(ids, dtype=torch.long, device=table.device)]


class ThinkerEngine(KVCacheEngine):
    """The thinker on the paged ``KVCacheEngine``; finished ``prefill`` and ``decode`` steps
    also output the embedding rows the talker needs (see the module's docstring). Raises as
    ``KVCacheEngine``."""

    def __init__(
        self,
        thinker: Thinker,
        spec: AttentionSpec,
        tokens: TalkerTokens,
        *,
        num_layers: int,
        kv_cache_bytes: int,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(
            thinker, spec, num_layers=num_layers, kv_cache_bytes=kv_cache_bytes, device=device
        )
        self.table = thinker.embed_tokens.weight
        self.tokens = tokens

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """``KVCacheEngine.forward``, with the rows added to each finished token step's
        outputs (one gather for the batch's sampled tokens). Raises as it does."""
        results = super().forward(steps)
        done = [
            (step, out)
            for step, out in zip(steps, results, strict=True)
            if isinstance(out, dict) and step.op in _ROW_OPS
        ]
        if done:
            with torch.inference_mode():
                sampled = self.table[torch.stack([out["token"] for _, out in done])]
                for (step, out), row in zip(done, sampled.unbind(0), strict=True):
                    out["row"] = row
                    if step.op == "prefill":
                        out["rows"] = talker_rows(self.table, step.inputs["tokens"], self.tokens)
                        out["tts"] = tts_rows(self.table, self.tokens)
        return results
