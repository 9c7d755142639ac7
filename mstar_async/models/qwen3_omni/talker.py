"""The talker and its code predictor: modules with upstream names, and their engine ops.

Per codec frame (upstream ``Qwen3OmniMoeTalkerForConditionalGeneration``):

1. the talker has sampled codebook 0 of the frame (``code``) from its last hidden state;
2. the code predictor, a small Qwen3 LM, starts a fresh sequence from ``[talker hidden,
   talker.codec_embedding(code 0)]`` and predicts codebooks ``1 .. G-1`` one by one
   (``lm_head[g]`` reads group ``g``; ``codec_embedding[g-1]`` embeds code ``g`` back in);
3. the talker's next input row is the sum of the frame's ``G`` codebook embeddings plus the
   next text row through ``text_projection``, and its next hidden state gives the next frame's
   codebook 0. The text rows are upstream's ``trailing_text_hidden``: the thinker's tokens after
   its first, one per frame, with ``tts_eos`` in place of its last one (upstream never feeds the
   token the thinker stopped on, end-of-text or not), then ``tts_pad`` for as long as the talker
   speaks on.

The talker's prompt is built as upstream's ``_get_talker_user_parts`` /
``_get_talker_assistant_parts`` do: every user turn's thinker embeddings through
``text_projection``, except at audio positions, where the thinker's hidden state after
``accept_hidden_layer`` layers goes through ``hidden_projection``; then the assistant header
with ``tts_pad`` x4 + ``tts_bos`` + the first generated text token on the text side and
``nothink, think_bos, think_eos, speaker, pad, bos`` on the codec side. Upstream builds it
afresh each turn from the whole conversation, but only its user turns lead it, and a
conversation's next turn repeats them: their rows are keyed (``talker_keys``), so a
conversation keeps their KV and its next turn computes only the new user turn and the header.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_async.engines.kv.prefill_rows import prompt_keys
from mstar_async.errors import EngineError
from mstar_async.graph import StreamEnd
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, Qwen3Stack
from mstar_async.models.qwen3_omni.embeds_engine import EmbedsOp, Sampler
from mstar_async.policies import Chunk

__all__ = [
    "CodePredictor",
    "Talker",
    "TalkerTokens",
    "predictor_ops",
    "talker_keys",
    "talker_ops",
]


@dataclass(frozen=True)
class TalkerTokens:
    """Special ids the talker's data flow needs.

    Codec ids live in the talker's vocabulary (above the codebook); ``tts_*`` ids in the
    thinker's; ``im_start`` / ``user`` / ``assistant`` are the thinker tokenizer's ids of
    ``<|im_start|>`` and of the first token of each role name.
    """

    codebook_size: int
    codec_eos: int
    codec_pad: int
    codec_bos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    tts_bos: int
    tts_eos: int
    tts_pad: int
    im_start: int
    user: int
    assistant: int
    speakers: Mapping[str, int] = field(default_factory=dict)
    audio_pad: int | None = None  # the thinker's audio placeholder (None: no audio input)


class ResizeMLP(nn.Module):
    """Thinker width -> talker width (upstream ``Qwen3OmniMoeTalkerResizeMLP``)."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(F.silu(self.linear_fc1(x)))
        return out


class CodePredictor(nn.Module):
    """Upstream ``talker.code_predictor``: ``model.{layers,norm,codec_embedding.{g}}``,
    ``lm_head.{g}`` for the ``G - 1`` residual codebooks."""

    def __init__(self, cfg: Qwen3Config, vocab: int, groups: int) -> None:
        super().__init__()
        self.model = Qwen3Stack(cfg)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(vocab, cfg.hidden_size) for _ in range(groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, vocab, bias=False) for _ in range(groups - 1)
        )

    def embed(self, group: int, code: int) -> torch.Tensor:
        """Embedding of ``code`` of residual codebook ``group`` (1-based), ``[hidden]``."""
        tables = self.model.codec_embedding
        assert isinstance(tables, nn.ModuleList)
        table = tables[group - 1]
        assert isinstance(table, nn.Embedding)
        return table.weight[code]


class Talker(nn.Module):
    """Upstream ``talker``: ``model.{layers,norm,codec_embedding}``, ``codec_head``,
    ``text_projection``, ``hidden_projection``, ``code_predictor``."""

    def __init__(
        self,
        cfg: Qwen3Config,
        *,
        vocab: int,
        thinker_hidden: int,
        predictor: Qwen3Config,
        codebook_size: int,
        groups: int,
    ) -> None:
        super().__init__()
        if predictor.hidden_size != cfg.hidden_size:
            raise ValueError(
                "the code predictor's hidden_size must equal the talker's (their embeddings are "
                f"summed), got {predictor.hidden_size} and {cfg.hidden_size}"
            )
        self.groups = groups
        self.model = Qwen3Stack(cfg)
        self.model.codec_embedding = nn.Embedding(vocab, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.text_projection = ResizeMLP(thinker_hidden, cfg.intermediate_size, cfg.hidden_size)
        self.hidden_projection = ResizeMLP(thinker_hidden, cfg.intermediate_size, cfg.hidden_size)
        self.code_predictor = CodePredictor(predictor, codebook_size, groups)

    @property
    def codec_embedding(self) -> nn.Embedding:
        """The talker's codec table (``model.codec_embedding``): codebook 0 and the specials."""
        table = self.model.codec_embedding
        assert isinstance(table, nn.Embedding)
        return table

    def frame_embedding(self, frame: torch.Tensor) -> torch.Tensor:
        """Sum of a frame's ``G`` codebook embeddings (talker table for codebook 0)."""
        codes = [int(c) for c in frame.tolist()]
        out = self.codec_embedding.weight[codes[0]].clone()
        for group, code in enumerate(codes[1:], start=1):
            out = out + self.code_predictor.embed(group, code)
        return out


def _code0(talker: Talker, tokens: TalkerTokens, hidden: torch.Tensor, sampler: Sampler) -> int:
    logits = talker.codec_head(hidden).float()
    # As upstream: the codec specials above the codebook are never predicted, except the end.
    eos = logits[tokens.codec_eos].clone()
    logits[tokens.codebook_size :] = float("-inf")
    logits[tokens.codec_eos] = eos
    return sampler.sample(logits)


def _after(
    talker: Talker, tokens: TalkerTokens, hidden: torch.Tensor, sampler: Sampler
) -> dict[str, Any]:
    code = _code0(talker, tokens, hidden, sampler)
    context = torch.stack([hidden, talker.codec_embedding.weight[code]])
    return {"code": torch.tensor(code), "context": context}


def talker_prompt(
    talker: Talker,
    thinker_embed: nn.Embedding,
    tokens: TalkerTokens,
    prompt: torch.Tensor,
    first: int,
    speaker: int,
    audio_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The talker's prefill rows for a prompt and the thinker's first generated token;
    ``audio_hidden`` holds the thinker's rows (after ``accept_hidden_layer`` layers) at the
    prompt's audio placeholders, in order.

    Raises:
        EngineError: the prompt has no ``<|im_start|>`` + assistant header, or audio
            placeholders in user turns without as many ``audio_hidden`` rows.
    """
    ids = [int(t) for t in prompt.reshape(-1).tolist()]
    user, a = _user_turns(tokens, ids)

    def project(token_ids: Sequence[int]) -> torch.Tensor:
        embedded = thinker_embed.weight[torch.tensor(list(token_ids), dtype=torch.long)]
        out: torch.Tensor = talker.text_projection(embedded)
        return out

    head = [*ids[a:], first]
    k = len(head) - 1
    assistant = project(head)
    pad, bos = project([tokens.tts_pad, tokens.tts_bos])
    text = torch.cat([assistant[:k], pad.expand(4, -1), bos[None], assistant[k:]])
    codec_ids = [
        tokens.codec_nothink,
        tokens.codec_think_bos,
        tokens.codec_think_eos,
        speaker,
        tokens.codec_pad,
        tokens.codec_bos,
    ]
    codec = talker.codec_embedding.weight[torch.tensor(codec_ids)]
    codec = torch.cat([codec.new_zeros(k, codec.shape[1]), codec])
    parts = [_user_rows(talker, project, tokens, user, audio_hidden)] if user else []
    return torch.cat([*parts, text + codec])


def _user_turns(tokens: TalkerTokens, ids: list[int]) -> tuple[list[int], int]:
    """The ids of every user turn before the last assistant header, in order (upstream's
    ``user_mask``: from a turn's ``<|im_start|>`` to the next one), and where that header is.

    Raises:
        EngineError: the prompt has no ``<|im_start|>`` + assistant header.
    """
    starts = [i for i, t in enumerate(ids) if t == tokens.im_start]
    heads = [i for i in starts if i + 1 < len(ids) and ids[i + 1] == tokens.assistant]
    if not heads:
        raise EngineError(
            "the talker needs a chat prompt ending in an assistant header "
            "(<|im_start|>assistant); build it with the chat template"
        )
    a = heads[-1]
    user = [
        t
        for s, e in zip(starts, [*starts[1:], a], strict=True)
        if s < a and s + 1 < len(ids) and ids[s + 1] == tokens.user
        for t in ids[s:e]
    ]
    return user, a


def talker_keys(
    tokens: TalkerTokens, prompt: torch.Tensor, audio_hidden: torch.Tensor | None
) -> list[Hashable]:
    """What each of the talker prompt's user-turn rows *is*, in order
    (``prefill_rows.prompt_keys``): a text row its thinker id, an audio row its id with a
    digest of the thinker row it projects. They lead the talker's prompt, and a
    conversation's next turn repeats them (upstream's talker reads every user turn, then the
    new reply's header), so they are the rows a next turn may take from a kept handle.
    ``audio_hidden`` may hold rows for a leading run of the audio positions only (what a
    rewound thinker still keeps): the keys then stop at the first audio position without one.

    Raises:
        EngineError: as ``talker_prompt``.
    """
    user, _ = _user_turns(tokens, [int(t) for t in prompt.reshape(-1).tolist()])
    pad = tokens.audio_pad
    at = [i for i, t in enumerate(user) if t == pad] if pad is not None else []
    known = min(len(at), 0 if audio_hidden is None else int(audio_hidden.shape[0]))
    rows = audio_hidden[:known] if audio_hidden is not None and known else None
    keys = prompt_keys(user, rows, torch.tensor(at[:known], dtype=torch.long))
    return keys if known == len(at) else keys[: at[known]]


def _user_rows(
    talker: Talker,
    project: Any,
    tokens: TalkerTokens,
    user: list[int],
    audio_hidden: torch.Tensor | None,
) -> torch.Tensor:
    """The user turns' rows: ``text_projection`` of their embeddings, and at audio
    placeholders ``hidden_projection`` of the thinker's hidden rows (upstream's
    ``_get_talker_user_parts``)."""
    rows: torch.Tensor = project(user)
    if tokens.audio_pad is None:
        return rows
    at = [i for i, t in enumerate(user) if t == tokens.audio_pad]
    if not at:
        return rows
    if audio_hidden is None or audio_hidden.shape[0] != len(at):
        got = 0 if audio_hidden is None else audio_hidden.shape[0]
        raise EngineError(
            f"the talker's prompt has {len(at)} audio positions in user turns but got {got} "
            "thinker rows for them (the thinker prefill's embeds_out; none when the config's "
            "talker_config.accept_hidden_layer is past the thinker's layers)"
        )
    heard: torch.Tensor = talker.hidden_projection(audio_hidden.to(rows.dtype))
    return rows.index_copy(0, torch.tensor(at, device=rows.device), heard)


def _text_token(tokens: TalkerTokens, text: Chunk | StreamEnd) -> int:
    """The thinker-vocabulary id of the talker's next text row. ``text`` is the text stream's
    chunk for this frame (one new token, looking one ahead) or, once the text has ended,
    ``StreamEnd``: a token as it comes, ``tts_eos`` for the last one (the final chunk), then
    ``tts_pad``."""
    if isinstance(text, StreamEnd):
        return tokens.tts_pad
    if text.final:
        return tokens.tts_eos
    return int(torch.as_tensor(text.new).reshape(-1)[0])


def _text_row(
    talker: Talker, thinker_embed: nn.Embedding, tokens: TalkerTokens, text: Chunk | StreamEnd
) -> torch.Tensor:
    out: torch.Tensor = talker.text_projection(thinker_embed.weight[_text_token(tokens, text)])
    return out


def talker_ops(
    talker: Talker, thinker_embed: nn.Embedding, tokens: TalkerTokens
) -> dict[str, EmbedsOp]:
    """The talker engine's ops.

    - ``prefill``: ``prompt`` (thinker prompt ids), ``first`` (thinker's first token),
      ``speaker`` (codec speaker id), ``audio_hidden`` (the thinker's rows at the prompt's
      audio placeholders, or None), ``sampling``, optional ``resume`` (a conversation's
      handle: its kept user-turn rows are reused) -> ``code`` (codebook 0 of frame 0),
      ``context`` (``[2, hidden]``: the code predictor's first rows). Its user-turn rows are
      keyed (``talker_keys``), for ``retain``.
    - ``decode``: ``text`` (the text stream's chunk holding the next thinker token, or
      ``StreamEnd`` after the text), ``code`` (this frame's codebook 0), ``codes`` (its residual
      codes from the predictor) -> ``frame`` (``[G]``), ``code`` and ``context`` for the next
      frame.
    """

    def prefill_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        speaker = int(inputs["speaker"])
        return talker_prompt(
            talker,
            thinker_embed,
            tokens,
            inputs["prompt"],
            int(inputs["first"]),
            speaker,
            inputs.get("audio_hidden"),
        )

    def decode_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        frame = _frame(inputs)
        row = talker.frame_embedding(frame) + _text_row(
            talker, thinker_embed, tokens, inputs["text"]
        )
        return row[None]

    def prefill_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [_after(talker, tokens, h, s) for h, s in zip(hidden, samplers, strict=True)]

    def decode_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [
            {**_after(talker, tokens, h, s), "frame": _frame(inputs)}
            for h, inputs, s in zip(hidden, batch, samplers, strict=True)
        ]

    def prefill_keys(inputs: Mapping[str, Any]) -> list[Hashable]:
        return talker_keys(tokens, inputs["prompt"], inputs.get("audio_hidden"))

    return {
        "prefill": EmbedsOp(
            prefill_rows,
            prefill_done,
            cost=lambda i: len(i["prompt"]) + 8,
            keys=prefill_keys,
        ),
        "decode": EmbedsOp(decode_rows, decode_done),
    }


def _frame(inputs: Mapping[str, Any]) -> torch.Tensor:
    code = torch.as_tensor(inputs["code"]).reshape(1).long()
    return torch.cat([code, torch.as_tensor(inputs["codes"]).reshape(-1).long()])


def predictor_ops(predictor: CodePredictor) -> dict[str, EmbedsOp]:
    """The code predictor engine's ops; each frame is a fresh sequence.

    - ``prefill``: ``context`` (``[2, hidden]``: talker hidden, codebook-0 embedding),
      ``sampling`` -> ``code`` (codebook 1), ``codes`` (``[1]``).
    - ``decode``: ``code`` (codebook g), ``codes`` (``[g]``) -> ``code`` (codebook g+1),
      ``codes`` (``[g+1]``).
    """

    def prefill_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        context: torch.Tensor = inputs["context"]
        return context

    def decode_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        group = int(torch.as_tensor(inputs["codes"]).numel())
        return predictor.embed(group, int(inputs["code"]))[None]

    def done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        out = []
        for h, inputs, sampler in zip(hidden, batch, samplers, strict=True):
            before = torch.as_tensor(inputs.get("codes", torch.zeros(0))).reshape(-1).long()
            head = predictor.lm_head[before.numel()]
            code = sampler.sample(head(h))
            codes = torch.cat([before, torch.tensor([code])])
            out.append({"code": torch.tensor(code), "codes": codes})
        return out

    return {
        "prefill": EmbedsOp(prefill_rows, done, fresh=True, cost=lambda i: 2),
        "decode": EmbedsOp(decode_rows, done),
    }
