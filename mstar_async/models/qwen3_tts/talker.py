"""The talker LM and its multi-codebook code predictor (upstream names), and their engine ops.

Upstream ``Qwen3TTSTalkerForConditionalGeneration``: a dense Qwen3 decoder (``talker.model``,
per-head q/k norms; its multimodal rotary positions reduce to plain ones for text) with two
tables, ``codec_embedding`` (codebook 0 and the codec specials) and ``text_embedding`` (the
text vocabulary at ``text_hidden_size``, brought to the talker's width by ``text_projection``);
``codec_head`` predicts codebook 0. The code predictor (``talker.code_predictor``) is a small
Qwen3 decoder that, per frame, starts a fresh sequence from ``[talker hidden, embedding of
code 0]``, brought to its width by ``small_to_mtp_projection``, and predicts codebooks
``1 .. G-1`` one by one (``lm_head[g-1]``; ``model.codec_embedding[g-1]`` embeds code ``g``
back, at the talker's width). The talker's next input is the sum of the frame's ``G``
codebook embeddings plus the next trailing text row (``tts_pad`` once the text is fed).

Shared with Qwen3-Omni: the decoder stack, the resize MLP, the code predictor and its ops,
upstream's codebook-0 rule and the embeds-fed KV engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar_async.errors import EngineError
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, Qwen3Stack
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsOp, Sampler
from mstar_async.models.qwen3_omni.talker import (
    NOTHING_SPOKEN,
    CodePredictor,
    ResizeMLP,
    frame_codes,
    next_code0,
    spoken,
)
from mstar_async.models.qwen3_tts.prompt import SPEAKER, row_keys

__all__ = ["TTSTalker", "TalkerIds", "talker_ops"]


@dataclass(frozen=True)
class TalkerIds:
    """Ids the talker's ops need: the codebook size (codec ids at or above it are specials,
    never sampled but ``codec_eos``), ``codec_eos``, and ``tts_pad`` (text vocabulary)."""

    codebook_size: int
    codec_eos: int
    tts_pad: int
    #: Frames before which end-of-speech is never sampled (upstream's ``min_new_tokens``).
    min_frames: int = 2


class TTSTalker(nn.Module):
    """Upstream ``talker``: ``model.{layers,norm,codec_embedding,text_embedding}``,
    ``text_projection``, ``codec_head``, ``code_predictor``."""

    def __init__(
        self,
        cfg: Qwen3Config,
        *,
        vocab: int,
        text_vocab: int,
        text_hidden: int,
        predictor: Qwen3Config,
        codebook_size: int,
        groups: int,
    ) -> None:
        super().__init__()
        self.groups = groups
        self.model = Qwen3Stack(cfg)
        self.model.codec_embedding = nn.Embedding(vocab, cfg.hidden_size)
        self.model.text_embedding = nn.Embedding(text_vocab, text_hidden)
        self.text_projection = ResizeMLP(text_hidden, text_hidden, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.code_predictor = CodePredictor(
            predictor, codebook_size, groups, talker_hidden=cfg.hidden_size
        )

    @property
    def codec_embedding(self) -> nn.Embedding:
        """Codebook 0 and the codec specials."""
        table = self.model.codec_embedding
        assert isinstance(table, nn.Embedding)
        return table

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Projected text embeddings of text-vocabulary ``ids`` ``[n]`` -> ``[n, hidden]``."""
        table = self.model.text_embedding
        assert isinstance(table, nn.Embedding)
        out: torch.Tensor = self.text_projection(table(ids.to(table.weight.device)))
        return out

    def frame_rows(self, frames: torch.Tensor) -> torch.Tensor:
        """Summed codebook embeddings of frames ``[n, G]`` -> ``[n, hidden]``."""
        frames = frames.to(self.codec_embedding.weight.device).long()
        out: torch.Tensor = self.codec_embedding(frames[:, 0])
        for group in range(1, self.groups):
            out = out + self.code_predictor.table(group)(frames[:, group])
        return out

    def prompt_rows(self, layout: torch.Tensor, speaker: torch.Tensor | None) -> torch.Tensor:
        """Embeddings of a prompt ``layout`` (see ``prompt.lay_out``) ``[n, hidden]``.

        Raises:
            EngineError: a speaker row without a speaker embedding (or of the wrong width).
        """
        weight = self.codec_embedding.weight
        layout = layout.to(weight.device).long()
        rows = weight.new_zeros(layout.shape[0], weight.shape[1])
        text, codec, frames = layout[:, 0], layout[:, 1], layout[:, 2:]
        has = text >= 0
        if has.any():
            rows[has] += self.text_rows(text[has])
        has = codec >= 0
        if has.any():
            rows[has] += self.codec_embedding(codec[has])
        has = codec == SPEAKER
        if has.any():
            if speaker is None or speaker.numel() != weight.shape[1]:
                raise EngineError(
                    f"the prompt has a speaker row but the voice's embedding is "
                    f"{None if speaker is None else tuple(speaker.shape)}, not [{weight.shape[1]}]"
                )
            rows[has] += speaker.to(weight.device, weight.dtype).reshape(1, -1)
        has = frames[:, 0] >= 0
        if has.any():
            rows[has] += self.frame_rows(frames[has])
        return rows


def _next(
    talker: TTSTalker, ids: TalkerIds, hidden: torch.Tensor, sampler: Sampler, seen: torch.Tensor
) -> dict[str, Any]:
    """``next_code0`` after the codebook-0 codes ``seen`` so far (the frame's index is their
    count): end of speech only from ``ids.min_frames`` frames on."""
    return next_code0(
        talker,
        hidden,
        sampler,
        seen,
        codebook_size=ids.codebook_size,
        codec_eos=ids.codec_eos,
        eos_allowed=seen.numel() >= ids.min_frames,
    )


def talker_ops(talker: TTSTalker, ids: TalkerIds) -> dict[str, EmbedsOp]:
    """The talker engine's ops.

    - ``prefill``: ``layout`` (``prompt.lay_out``), ``speaker`` (the voice's embedding or an
      empty tensor), ``sampling`` -> ``code`` (codebook 0 of frame 0), ``context`` (``[2,
      hidden]``: the code predictor's first rows), ``history`` (``[1]``). For a registered
      voice also ``voice_id``, ``voice_rows`` (the layout's leading rows every request of the
      voice shares, keyed by ``prompt.row_keys``) and the engine's ``resume`` / ``keep`` (the
      voice's handle): those rows' KV is computed once and reused.
    - ``decode``: ``code`` and ``codes`` (this frame), ``trailing`` (text ids fed per frame),
      ``history`` (codebook 0 of every frame so far, this one last: upstream's generated ids,
      which its repetition penalty reads) -> ``frame`` (``[G]``), and ``code``, ``context``,
      ``history`` for the next frame.
    """

    def prefill_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        speaker = inputs.get("speaker")
        if speaker is not None and not torch.as_tensor(speaker).numel():
            speaker = None
        return talker.prompt_rows(torch.as_tensor(inputs["layout"]), speaker)

    def decode_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        step = spoken(inputs).numel() - 1
        trailing = torch.as_tensor(inputs["trailing"]).reshape(-1)
        text = int(trailing[step]) if step < trailing.numel() else ids.tts_pad
        row = talker.frame_rows(frame_codes(inputs)[None]) + talker.text_rows(torch.tensor([text]))
        return row

    def prefill_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [
            _next(talker, ids, h, s, NOTHING_SPOKEN) for h, s in zip(hidden, samplers, strict=True)
        ]

    def decode_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [
            {**_next(talker, ids, h, s, spoken(inputs)), "frame": frame_codes(inputs)}
            for h, inputs, s in zip(hidden, batch, samplers, strict=True)
        ]

    def prefill_keys(inputs: Mapping[str, Any]) -> list[Hashable]:
        layout = torch.as_tensor(inputs["layout"])
        return row_keys(layout, int(inputs["voice_rows"]), str(inputs["voice_id"]))

    return {
        "prefill": EmbedsOp(
            prefill_rows,
            prefill_done,
            cost=lambda i: int(torch.as_tensor(i["layout"]).shape[0]),
            keys=prefill_keys,
        ),
        "decode": EmbedsOp(decode_rows, decode_done),
    }
