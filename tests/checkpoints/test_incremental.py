"""IncrementalDecoder: streaming text must equal the full decode and never show U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.models.checkpoints import ChatTokenizer, IncrementalDecoder
from tests.checkpoints.tiny import train_tokenizer

MULTIBYTE = "héllo 世界 🙂"


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer(train_tokenizer("smollm"), eos_token="<|im_end|>")


def stream(tokenizer: ChatTokenizer, ids: list[int], **kwargs: bool) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, **kwargs)
    pieces = [decoder.push(token_id) for token_id in ids]
    pieces.append(decoder.finish())
    return pieces


def test_multibyte_characters_split_across_tokens(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    # The tiny vocabulary has no merges for these characters, so each spans several tokens.
    assert len(ids) > len(MULTIBYTE)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == MULTIBYTE
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1]  # something was held back mid-character
    assert "🙂" in pieces


def test_special_tokens_are_skipped_or_kept(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>hi 世<|im_end|>")
    assert "".join(stream(tokenizer, ids)) == "hi 世"
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "<|im_start|>hi 世<|im_end|>"


def test_finish_releases_an_unfinished_character(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode("a🙂")
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(token_id) for token_id in ids[:-1]]
    assert pieces[0] == "a"
    assert set(pieces[1:]) == {""}  # the emoji's first bytes are held back
    rest = decoder.finish()
    assert rest and set(rest) == {"\ufffd"}
    assert decoder.finish() == ""


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_stream_equals_full_decode(tokenizer: ChatTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text
