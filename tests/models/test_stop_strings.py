"""StopStrings: the emitted text is the input cut before its first stop, however it is split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.models.stop_strings import StopStrings

ALPHABET = "abc"


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
)
def test_emitted_text_is_the_text_before_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    matcher = StopStrings(stops)
    emitted = "".join(matcher.push(p) for p in pieces) + matcher.finish()
    assert (emitted, matcher.stopped) == reference("".join(pieces), stops)


def test_a_longer_stop_begun_earlier_wins_over_a_shorter_one_seen_first() -> None:
    matcher = StopStrings(["c", "aca"])
    assert matcher.push("ac") == "" and not matcher.stopped
    assert matcher.push("a") == "" and matcher.stopped
    ended = StopStrings(["c", "aca"])
    assert ended.push("xac") == "x" and ended.finish() == "a" and ended.stopped


def test_holds_back_a_possible_stop_until_it_is_decided() -> None:
    matcher = StopStrings(["</s>"])
    assert matcher.push("hello </") == "hello "
    assert matcher.push("b>") == "</b>"
    assert matcher.push(" bye </s> more") == " bye "
    assert matcher.stopped and matcher.push("x") == "" and matcher.finish() == ""


def test_empty_stop_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""])
