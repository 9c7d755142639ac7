"""Orpheus' token layout: special tokens, audio codes in the vocabulary, and the prompt format.

Orpheus extends a Llama-3 vocabulary with "custom tokens" ``<custom_token_N>`` at
``custom_base + N`` (``custom_base`` is 128256 in the released checkpoints). The first ten are
control tokens; from ``N = 10`` on, each id is one SNAC code tagged with its place in a frame:

    id = custom_base + 10 + code + position * 4096,  position = index in the frame (0..6)

A frame of 7 codes is one SNAC frame: ``[c0, c1, c2, c3, c4, c5, c6]`` holds codebook 0's code
``c0``, codebook 1's codes ``c1, c4`` and codebook 2's codes ``c2, c3, c5, c6``.

A prompt is ``<start_of_human> BOS "voice: text" <eot> <end_of_human> <start_of_ai>
<start_of_speech>``; the model answers with frames of codes and ``<end_of_speech>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CODEBOOK_SIZE = 4096
CODES_PER_FRAME = 7
CONTROL_TOKENS = 10
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""The voices of the released fine-tuned checkpoint, used as prompt prefixes."""

# Offsets of the control tokens from custom_base (<custom_token_N>).
_START_OF_SPEECH, _END_OF_SPEECH = 1, 2
_START_OF_HUMAN, _END_OF_HUMAN = 3, 4
_START_OF_AI, _END_OF_AI, _PAD = 5, 6, 7

# Which codebook each of a frame's 7 codes belongs to.
_FRAME_LAYOUT = (0, 1, 2, 2, 1, 2, 2)


@dataclass(frozen=True)
class OrpheusVocab:
    """Where Orpheus' tokens sit in a vocabulary: ``custom_base`` plus the text tokenizer's
    BOS and end-of-turn ids. ``OrpheusVocab.upstream()`` is the released checkpoints' layout."""

    custom_base: int
    bos: int
    end_of_text: int

    @classmethod
    def upstream(cls) -> OrpheusVocab:
        """The Llama-3 based layout of the released checkpoints (custom tokens from 128256)."""
        return cls(custom_base=128256, bos=128000, end_of_text=128009)

    @property
    def start_of_speech(self) -> int:
        """``<custom_token_1>``: the prompt's last token; codes follow it."""
        return self.custom_base + _START_OF_SPEECH

    @property
    def end_of_speech(self) -> int:
        """``<custom_token_2>``: the model's stop token."""
        return self.custom_base + _END_OF_SPEECH

    @property
    def start_of_human(self) -> int:
        """``<custom_token_3>``: opens the prompt."""
        return self.custom_base + _START_OF_HUMAN

    @property
    def end_of_human(self) -> int:
        """``<custom_token_4>``."""
        return self.custom_base + _END_OF_HUMAN

    @property
    def start_of_ai(self) -> int:
        """``<custom_token_5>``."""
        return self.custom_base + _START_OF_AI

    @property
    def end_of_ai(self) -> int:
        """``<custom_token_6>``."""
        return self.custom_base + _END_OF_AI

    @property
    def code_base(self) -> int:
        """Id of code 0 at position 0 (``<custom_token_10>``)."""
        return self.custom_base + CONTROL_TOKENS

    @property
    def code_end(self) -> int:
        """One past the last audio-code id."""
        return self.code_base + CODES_PER_FRAME * CODEBOOK_SIZE

    @property
    def min_vocab_size(self) -> int:
        """The smallest LM vocabulary that holds every audio code."""
        return self.code_end

    def code_token(self, code: int, position: int) -> int:
        """The token id of SNAC ``code`` at ``position`` (0..6) in its frame.

        Raises:
            ValueError: ``code`` or ``position`` is out of range.
        """
        if not (0 <= code < CODEBOOK_SIZE and 0 <= position < CODES_PER_FRAME):
            raise ValueError(
                f"code must be in [0, 4096) and position in [0, 7), got {code}, {position}"
            )
        return self.code_base + code + position * CODEBOOK_SIZE

    def split_code(self, token: int) -> tuple[int, int] | None:
        """``(position, code)`` of an audio-code token, or None for any other token."""
        if not self.code_base <= token < self.code_end:
            return None
        position, code = divmod(token - self.code_base, CODEBOOK_SIZE)
        return position, code

    def prompt_ids(self, text_ids: Sequence[int]) -> list[int]:
        """The whole prompt around ``text_ids`` (the tokenized ``"voice: text"``, BOS included)."""
        return [
            self.start_of_human,
            *text_ids,
            self.end_of_text,
            self.end_of_human,
            self.start_of_ai,
            self.start_of_speech,
        ]


def prompt_text(text: str, voice: str | None) -> str:
    """``"voice: text"`` as the model was trained on, or the bare text without a voice.

    Raises:
        ValueError: ``text`` is empty.
    """
    if not text.strip():
        raise ValueError("text is empty: give the words to speak")
    return f"{voice}: {text}" if voice else text


def parse_frames(tokens: Sequence[int], vocab: OrpheusVocab) -> tuple[list[list[int]], list[int]]:
    """The complete 7-code frames in ``tokens`` as SNAC codes, and the index in ``tokens`` of
    each frame's last code.

    Tokens that are not audio codes are skipped (a stray text token never reaches SNAC, as
    upstream skips it), and a code whose frame position breaks the 0..6 sequence drops the
    partial frame it interrupts, so every frame handed on is well formed. A trailing partial
    frame is left out. Pure; never raises.
    """
    frames: list[list[int]] = []
    ends: list[int] = []
    current: list[int] = []
    for index, token in enumerate(tokens):
        split = vocab.split_code(int(token))
        if split is None:
            continue
        position, code = split
        if position != len(current):
            current = []
            if position != 0:
                continue
        current.append(code)
        if len(current) == CODES_PER_FRAME:
            frames.append(current)
            ends.append(index)
            current = []
    return frames, ends


def codebooks(frames: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """SNAC's three code tensors ``[1, F]``, ``[1, 2F]``, ``[1, 4F]`` for ``F`` frames."""
    books: list[list[int]] = [[], [], []]
    for frame in frames:
        for code, book in zip(frame, _FRAME_LAYOUT, strict=True):
            books[book].append(code)
    return [torch.tensor(b, dtype=torch.long).unsqueeze(0) for b in books]
