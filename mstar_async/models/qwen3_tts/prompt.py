"""The talker's prompt as ids: which text token, codec id and reference frame make each row.

Pure and synchronous (no weights): the request program lays the prompt out, and the talker's
engine turns each row into an embedding (``talker.prompt_rows``). A row is the sum of what is
present among: the projected text embedding of ``text`` (>= 0), the codec embedding of
``codec`` (>= 0) or the voice's speaker embedding (``codec == SPEAKER``), and the summed
codebook embeddings of a reference frame (``frame[0] >= 0``).

Upstream's layout (``Qwen3TTSForConditionalGeneration.generate``), for the chat text
``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``:

- an instruction, if any (``<|im_start|>user\\n{instruct}<|im_end|>\\n``), text rows only;
- the role ``<|im_start|>assistant\\n`` (the first 3 ids), text rows only;
- codec tags ``nothink, think_bos, think_eos`` (or ``think, think_bos, language,
  think_eos``), the speaker, ``pad``, each over ``tts_pad`` text but the last over ``tts_bos``;
- then, without reference codes: streaming text, the first text token over codec ``bos``,
  the rest (and ``tts_eos``) fed one per generated frame; non-streaming text, every text token
  and ``tts_eos`` over codec ``pad``, then ``tts_pad`` over ``bos``;
- with reference codes (in-context cloning): the text is the reference transcript then the
  target text then ``tts_eos``, the codec side ``bos`` then the reference frames; streaming,
  the two are added row by row over the shorter length and the text's remainder is fed per
  frame (or ``tts_pad`` fills a shorter text); non-streaming, all the text over ``pad``, then
  ``bos`` and the frames over ``tts_pad``.

So a request's prompt is not a voice's prompt followed by the request's text: the reference
frames are added to the text row by row, and only the rows before the first one that carries
the text to speak (the instruction, the role, the codec tags with the speaker, and in context
the rows of the reference transcript) are the same for every request of a voice
(``TalkerPrompt.voice_rows``; ``row_keys`` says what each of them is).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["SPEAKER", "PromptIds", "TalkerPrompt", "lay_out", "row_keys"]

#: ``codec`` value of the row that carries the voice's speaker embedding.
SPEAKER = -2
_NONE = -1


@dataclass(frozen=True)
class PromptIds:
    """The special ids the layout needs (codec ids in the talker's vocabulary, ``tts_*`` in
    the text vocabulary)."""

    codec_pad: int
    codec_bos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    tts_bos: int
    tts_eos: int
    tts_pad: int
    groups: int


@dataclass(frozen=True)
class TalkerPrompt:
    """``layout`` ``[rows, 2 + G]`` (text id, codec id, G frame codes; -1 where absent),
    ``trailing`` (text ids fed one per generated frame after the prompt; ``tts_pad`` after) and
    ``voice_rows``: how many leading rows do not depend on the text to speak."""

    layout: torch.Tensor
    trailing: torch.Tensor
    voice_rows: int = 0


def lay_out(
    ids: PromptIds,
    role: Sequence[int],
    text: Sequence[int],
    *,
    instruct: Sequence[int] = (),
    language: int | None = None,
    speaker: int | None = None,
    ref_text: Sequence[int] | None = None,
    ref_codes: torch.Tensor | None = None,
    streaming_text: bool = True,
) -> TalkerPrompt:
    """Lay out the talker's prompt.

    ``role`` are the ids of ``<|im_start|>assistant\\n`` and ``text`` those of the text, cut
    from the chat string as upstream does (its ``[:3]`` and ``[3:-5]``; see ``model.chat_ids``);
    ``instruct`` the ids of the whole instruction turn; ``speaker`` a codec id, ``SPEAKER`` for
    an embedding, ``None`` for none; ``ref_text`` the transcript's ids (cut likewise, upstream's
    ``[3:-2]``) and ``ref_codes`` ``[frames, G]`` for in-context cloning.

    Raises:
        ValueError: a chat text with no token, reference codes without a transcript or of the
            wrong width.
    """
    if not text:
        raise ValueError("the text to speak is empty; give at least one word")
    rows: list[list[int]] = []
    blank = [_NONE] * ids.groups

    def add(text: int, codec: int, frame: Sequence[int] = blank) -> None:
        rows.append([text, codec, *frame])

    for t in instruct:
        add(t, _NONE)
    for t in role:
        add(t, _NONE)
    tags = (
        [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos]
        if language is None
        else [ids.codec_think, ids.codec_think_bos, language, ids.codec_think_eos]
    )
    codec = [*tags, *([] if speaker is None else [speaker]), ids.codec_pad, ids.codec_bos]
    for i, c in enumerate(codec[:-1]):
        add(ids.tts_bos if i == len(codec) - 2 else ids.tts_pad, c)
    text = list(text)
    trailing: list[int] = []
    voice_rows = len(rows)
    if ref_codes is None:
        if streaming_text:
            add(text[0], ids.codec_bos)
            trailing = [*text[1:], ids.tts_eos]
        else:
            for t in [*text, ids.tts_eos]:
                add(t, ids.codec_pad)
            add(ids.tts_pad, ids.codec_bos)
    else:
        if not ref_text:
            raise ValueError("in-context cloning needs the reference audio's transcript")
        if ref_codes.dim() != 2 or ref_codes.shape[1] != ids.groups:
            raise ValueError(
                f"reference codes must be [frames, {ids.groups}], got {tuple(ref_codes.shape)}"
            )
        seq = [*ref_text, *text, ids.tts_eos]
        frames = [[int(c) for c in f] for f in ref_codes.tolist()]
        codec_rows: list[tuple[int, list[int]]] = [(ids.codec_bos, blank)]
        codec_rows += [(_NONE, f) for f in frames]
        # The transcript's rows precede the text's; streamed, no further than the codec rows.
        voice_rows += len(ref_text) if not streaming_text else min(len(ref_text), len(codec_rows))
        if not streaming_text:
            for t in seq:
                add(t, ids.codec_pad)
            for c, f in codec_rows:
                add(ids.tts_pad, c, f)
        else:
            n = len(codec_rows)
            padded = seq[:n] + [ids.tts_pad] * max(0, n - len(seq))
            for t, (c, f) in zip(padded, codec_rows, strict=True):
                add(t, c, f)
            trailing = seq[n:]
    return TalkerPrompt(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(trailing, dtype=torch.long),
        voice_rows,
    )


def row_keys(layout: torch.Tensor, rows: int, voice: str) -> list[Hashable]:
    """What each of the first ``rows`` rows of ``layout`` is (``prefill_rows.prompt_keys``'s
    role, for ``resume``): its ids as a tuple (text id, codec id, frame codes: all a row's
    embedding depends on), but the speaker row, which is ``("speaker", voice)``: the
    embedding of registered voice ``voice``. Pure; raises nothing for a layout of
    ``lay_out``."""
    keys: list[Hashable] = []
    for row in layout[:rows].tolist():
        keys.append(("speaker", voice) if row[1] == SPEAKER else tuple(row))
    return keys
