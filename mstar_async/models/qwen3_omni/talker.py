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

The talker never looks a token up in the thinker's embedding table: as upstream's talker reads
the thinker's ``hidden_states[0]``, it gets the thinker's input embedding rows themselves (the
thinker's engine hands them out: ``thinker_engine``), so a rank holding the talker reads none
of the thinker's weights. ``prompt_layout`` says which prompt positions' rows it needs.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    "NOTHING_SPOKEN",
    "REPETITION_PENALTY",
    "TTS_BOS",
    "TTS_EOS",
    "TTS_PAD",
    "CodePredictor",
    "CodecTalker",
    "PromptLayout",
    "Talker",
    "TalkerTokens",
    "frame_codes",
    "next_code0",
    "predictor_ops",
    "prompt_layout",
    "sample_code0",
    "spoken",
    "talker_keys",
    "talker_ops",
    "talker_prompt",
    "text_row",
]

#: Rows of the talker's ``tts`` input: the thinker's embeddings of ``tts_bos``, ``tts_eos`` and
#: ``tts_pad``, in upstream's order.
TTS_BOS, TTS_EOS, TTS_PAD = 0, 1, 2

#: Upstream's default repetition penalty on a talker's codebook-0 codes generated so far
#: (Qwen3-Omni's ``talker_repetition_penalty``, Qwen3-TTS's ``repetition_penalty``); their
#: code predictors take none.
REPETITION_PENALTY = 1.05
#: Nothing spoken yet: the codes a talker prefill's penalty reads (``next_code0``'s ``seen``).
NOTHING_SPOKEN = torch.zeros(0, dtype=torch.long)


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
    """Upstream ``talker.code_predictor``: ``model.{layers,norm,codec_embedding.{g}}`` and
    ``lm_head.{g}`` for the ``G - 1`` residual codebooks; its tables are at the talker's width
    (``talker_hidden``, its own by default), and ``small_to_mtp_projection`` (Qwen3-TTS's,
    absent when the widths are equal) brings rows at that width to its own."""

    def __init__(
        self, cfg: Qwen3Config, vocab: int, groups: int, *, talker_hidden: int | None = None
    ) -> None:
        super().__init__()
        width = cfg.hidden_size if talker_hidden is None else talker_hidden
        self.model = Qwen3Stack(cfg)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(vocab, width) for _ in range(groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, vocab, bias=False) for _ in range(groups - 1)
        )
        self.small_to_mtp_projection: nn.Module = (
            nn.Identity()
            if cfg.hidden_size == width
            else nn.Linear(width, cfg.hidden_size, bias=True)
        )

    def table(self, group: int) -> nn.Embedding:
        """Embedding table of residual codebook ``group`` (1-based), at the talker's width."""
        tables = self.model.codec_embedding
        assert isinstance(tables, nn.ModuleList)
        table = tables[group - 1]
        assert isinstance(table, nn.Embedding)
        return table

    def embed(self, group: int, code: int) -> torch.Tensor:
        """Embedding of ``code`` of residual codebook ``group`` (1-based), ``[talker hidden]``."""
        return self.table(group).weight[code]

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Talker-width rows -> the predictor's width."""
        out: torch.Tensor = self.small_to_mtp_projection(rows)
        return out


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


def sample_code0(
    logits: torch.Tensor,
    sampler: Sampler,
    *,
    codebook_size: int,
    codec_eos: int,
    eos_allowed: bool = True,
    seen: torch.Tensor | None = None,
) -> int:
    """Codebook 0 of a frame from the talker's codec logits ``[vocab]``, as upstream samples
    it: the codec specials above the codebook are never predicted, except the end of speech
    where ``eos_allowed``; codes in ``seen`` take the request's repetition penalty (see
    ``Sampler.sample``). Raises nothing."""
    logits = logits.float()
    eos = logits[codec_eos].clone()
    logits[codebook_size:] = float("-inf")
    if eos_allowed:
        logits[codec_eos] = eos
    return sampler.sample(logits, seen)


class CodecTalker(Protocol):
    """A talker that samples codebook 0: its ``codec_head`` and ``codec_embedding`` table
    (``Talker`` here, qwen3-tts's ``TTSTalker``)."""

    codec_head: nn.Linear

    @property
    def codec_embedding(self) -> nn.Embedding: ...


def next_code0(
    talker: CodecTalker,
    hidden: torch.Tensor,
    sampler: Sampler,
    seen: torch.Tensor,
    *,
    codebook_size: int,
    codec_eos: int,
    eos_allowed: bool = True,
) -> dict[str, Any]:
    """The talker step's outputs for the next frame, from its last ``hidden`` state: codebook
    0 (``code``, by ``sample_code0``, the codes in ``seen`` penalised), the code predictor's
    first rows for it (``context``: ``[hidden, embedding of code]``) and ``seen`` with it
    (``history``). ``seen`` holds codebook 0 of every frame so far, upstream's generated ids,
    which its repetition penalty reads (not the prompt's). Raises nothing."""
    code = sample_code0(
        talker.codec_head(hidden),
        sampler,
        codebook_size=codebook_size,
        codec_eos=codec_eos,
        eos_allowed=eos_allowed,
        seen=seen,
    )
    context = torch.stack([hidden, talker.codec_embedding.weight[code]])
    history = torch.cat([seen.reshape(-1).long(), torch.tensor([code])])
    return {"code": torch.tensor(code), "context": context, "history": history}


def spoken(inputs: Mapping[str, Any]) -> torch.Tensor:
    """A talker decode step's ``history`` input: codebook 0 of every frame so far, this one
    last (``[n]`` int64). Raises KeyError when the step has none."""
    return torch.as_tensor(inputs["history"]).reshape(-1).long()


@dataclass(frozen=True)
class PromptLayout:
    """Where the talker's prompt comes from in the thinker's prompt (``prompt_layout``).

    Attributes:
        user: the positions of the user turns, in order.
        heard: those of them that are audio placeholders.
        head: where the last assistant header (``<|im_start|>assistant``) starts.
        length: the prompt's length.
    """

    user: tuple[int, ...]
    heard: tuple[int, ...]
    head: int
    length: int

    @property
    def text(self) -> list[int]:
        """The positions whose thinker embeddings the talker projects, in order: the user
        turns' text (not their audio placeholders), then the assistant header to the end."""
        heard = set(self.heard)
        return [p for p in self.user if p not in heard] + list(range(self.head, self.length))


def prompt_layout(prompt: Sequence[int], tokens: TalkerTokens) -> PromptLayout | None:
    """The layout of a thinker prompt (ids) for the talker; None when it has no
    ``<|im_start|>assistant`` header."""
    starts = [i for i, t in enumerate(prompt) if t == tokens.im_start]
    heads = [i for i in starts if i + 1 < len(prompt) and prompt[i + 1] == tokens.assistant]
    if not heads:
        return None
    a = heads[-1]
    user = tuple(
        p
        for s, e in zip(starts, [*starts[1:], a], strict=True)
        if s < a and s + 1 < len(prompt) and prompt[s + 1] == tokens.user
        for p in range(s, e)
    )
    heard = (
        () if tokens.audio_pad is None else tuple(p for p in user if prompt[p] == tokens.audio_pad)
    )
    return PromptLayout(user, heard, a, len(prompt))


def _chat_layout(prompt: Sequence[int], tokens: TalkerTokens) -> PromptLayout:
    """``prompt_layout``, for a prompt the talker must speak to.

    Raises:
        EngineError: the prompt has no ``<|im_start|>`` + assistant header.
    """
    layout = prompt_layout(prompt, tokens)
    if layout is None:
        raise EngineError(
            "the talker needs a chat prompt ending in an assistant header "
            "(<|im_start|>assistant); build it with the chat template"
        )
    return layout


def _from_thinker(talker: Talker, rows: torch.Tensor) -> torch.Tensor:
    """Thinker rows on the talker's device (they may come from another rank) and in its dtype
    (the same one: a no-op)."""
    return rows.to(talker.text_projection.linear_fc1.weight)


def _project(talker: Talker, rows: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = talker.text_projection(_from_thinker(talker, rows))
    return out


def talker_prompt(
    talker: Talker,
    tokens: TalkerTokens,
    prompt: torch.Tensor,
    rows: torch.Tensor | None,
    first: torch.Tensor,
    tts: torch.Tensor,
    speaker: int,
    audio_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The talker's prefill rows for a thinker prompt (ids) and the thinker's first generated
    token. ``rows`` are the thinker's input embeddings at ``prompt_layout(prompt).text``,
    ``first`` that of the first token (``[hidden]``), ``tts`` those of ``tts_bos``, ``tts_eos``
    and ``tts_pad`` (the thinker prefill's ``rows``, ``row`` and ``tts``); ``audio_hidden``
    holds the thinker's rows (after ``accept_hidden_layer`` layers) at the prompt's audio
    placeholders, in order.

    Raises:
        EngineError: the prompt has no ``<|im_start|>`` + assistant header, ``rows`` do not
            match its layout, or audio placeholders in user turns come without as many
            ``audio_hidden`` rows.
    """
    layout = _chat_layout([int(t) for t in prompt.reshape(-1).tolist()], tokens)
    want = len(layout.text)
    if rows is None or rows.dim() != 2 or rows.shape[0] != want:
        got = None if rows is None else tuple(rows.shape)
        raise EngineError(
            f"the talker's prompt needs the thinker's embedding rows at {want} positions (the "
            f"thinker prefill's rows), got {got}"
        )
    k = layout.length - layout.head
    user = want - k
    assistant = _project(talker, torch.cat([rows[user:], first.reshape(1, -1).to(rows)]))
    pad, bos = _project(talker, tts[[TTS_PAD, TTS_BOS]])
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
    parts = [_user_rows(talker, layout, rows[:user], audio_hidden)] if layout.user else []
    return torch.cat([*parts, text + codec])


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
    ids = [int(t) for t in prompt.reshape(-1).tolist()]
    layout = _chat_layout(ids, tokens)
    user = [ids[p] for p in layout.user]
    heard = set(layout.heard)
    at = [i for i, p in enumerate(layout.user) if p in heard]
    known = min(len(at), 0 if audio_hidden is None else int(audio_hidden.shape[0]))
    rows = audio_hidden[:known] if audio_hidden is not None and known else None
    keys = prompt_keys(user, rows, torch.tensor(at[:known], dtype=torch.long))
    return keys if known == len(at) else keys[: at[known]]


def _user_rows(
    talker: Talker,
    layout: PromptLayout,
    rows: torch.Tensor,
    audio_hidden: torch.Tensor | None,
) -> torch.Tensor:
    """The user turns' rows: ``text_projection`` of the thinker's embeddings of their text,
    and at audio placeholders ``hidden_projection`` of the thinker's hidden rows (upstream's
    ``_get_talker_user_parts``)."""
    text = _project(talker, rows)
    if not layout.heard:
        return text
    if audio_hidden is None or audio_hidden.shape[0] != len(layout.heard):
        got = 0 if audio_hidden is None else audio_hidden.shape[0]
        raise EngineError(
            f"the talker's prompt has {len(layout.heard)} audio positions in user turns but got "
            f"{got} thinker rows for them (the thinker prefill's embeds_out; none when the "
            "config's talker_config.accept_hidden_layer is past the thinker's layers)"
        )
    heard: torch.Tensor = talker.hidden_projection(audio_hidden.to(text))
    audio = set(layout.heard)
    at_text = [i for i, p in enumerate(layout.user) if p not in audio]
    at_audio = [i for i, p in enumerate(layout.user) if p in audio]
    out = text.new_empty(len(layout.user), text.shape[1])
    out.index_copy_(0, torch.tensor(at_text, device=out.device), text)
    return out.index_copy_(0, torch.tensor(at_audio, device=out.device), heard)


def text_row(talker: Talker, tts: torch.Tensor, text: Chunk | StreamEnd) -> torch.Tensor:
    """The talker's text row for one frame (``[hidden]``): ``text_projection`` of a thinker
    embedding row. ``text`` is the text stream's chunk for this frame (the row of one new
    token, looking one ahead) or, once the text has ended, ``StreamEnd``: a token's row as it
    comes, ``tts_eos``'s for the last one (the final chunk), then ``tts_pad``'s (rows of
    ``tts``)."""
    if isinstance(text, StreamEnd):
        row = tts[TTS_PAD]
    elif text.final:
        row = tts[TTS_EOS]
    else:
        row = torch.as_tensor(text.new)[0]
    return _project(talker, row)


def talker_ops(talker: Talker, tokens: TalkerTokens) -> dict[str, EmbedsOp]:
    """The talker engine's ops; thinker rows are the thinker's input embeddings (see
    ``talker_prompt``).

    - ``prefill``: ``prompt`` (thinker prompt ids), ``rows`` (thinker rows at the prompt's
      ``prompt_layout(...).text``), ``first`` (the thinker's first token's row), ``tts`` (rows
      of ``tts_bos``, ``tts_eos``, ``tts_pad``), ``speaker`` (codec speaker id),
      ``audio_hidden`` (the thinker's rows at the prompt's audio placeholders, or None),
      ``sampling``, optional ``resume`` (a conversation's handle: its kept user-turn rows are
      reused) -> ``code`` (codebook 0 of frame 0), ``context`` (``[2, hidden]``: the code
      predictor's first rows), ``history`` (``[1]``: the code). Its user-turn rows are keyed
      (``talker_keys``), for ``retain``.
    - ``decode``: ``text`` (the text stream's chunk holding the next thinker token's row, or
      ``StreamEnd`` after the text), ``tts``, ``code`` (this frame's codebook 0), ``codes`` (its
      residual codes from the predictor), ``history`` (codebook 0 of every frame so far, this
      one last) -> ``frame`` (``[G]``), and ``code``, ``context``, ``history`` for the next
      frame (see ``next_code0``; the sampling's ``repetition_penalty`` applies to ``history``).
    """

    def prefill_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        return talker_prompt(
            talker,
            tokens,
            inputs["prompt"],
            inputs["rows"],
            inputs["first"],
            inputs["tts"],
            int(inputs["speaker"]),
            inputs.get("audio_hidden"),
        )

    def decode_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        row = talker.frame_embedding(frame_codes(inputs)) + text_row(
            talker, inputs["tts"], inputs["text"]
        )
        return row[None]

    def after(hidden: torch.Tensor, sampler: Sampler, seen: torch.Tensor) -> dict[str, Any]:
        return next_code0(
            talker,
            hidden,
            sampler,
            seen,
            codebook_size=tokens.codebook_size,
            codec_eos=tokens.codec_eos,
        )

    def prefill_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [after(h, s, NOTHING_SPOKEN) for h, s in zip(hidden, samplers, strict=True)]

    def decode_done(
        hidden: torch.Tensor, batch: Sequence[Mapping[str, Any]], samplers: Sequence[Sampler]
    ) -> list[dict[str, Any]]:
        return [
            {**after(h, s, spoken(inputs)), "frame": frame_codes(inputs)}
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


def frame_codes(inputs: Mapping[str, Any]) -> torch.Tensor:
    """A talker decode step's frame ``[G]``: its ``code`` (codebook 0) and ``codes`` (the rest,
    from the code predictor). Raises nothing for well-formed steps."""
    code = torch.as_tensor(inputs["code"]).reshape(1).long()
    return torch.cat([code, torch.as_tensor(inputs["codes"]).reshape(-1).long()])


def predictor_ops(predictor: CodePredictor) -> dict[str, EmbedsOp]:
    """The code predictor engine's ops; each frame is a fresh sequence.

    - ``prefill``: ``context`` (``[2, talker hidden]``: talker hidden, codebook-0 embedding),
      ``sampling`` -> ``code`` (codebook 1), ``codes`` (``[1]``).
    - ``decode``: ``code`` (codebook g), ``codes`` (``[g]``) -> ``code`` (codebook g+1),
      ``codes`` (``[g+1]``).
    """

    def prefill_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        return predictor.project(torch.as_tensor(inputs["context"]))

    def decode_rows(inputs: Mapping[str, Any]) -> torch.Tensor:
        group = int(torch.as_tensor(inputs["codes"]).numel())
        return predictor.project(predictor.embed(group, int(inputs["code"]))[None])

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
