"""Segmenting pushed text into sentences, and speaking segments one request at a time."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.outputs import AudioChunk
from mstar_async.server.segments import (
    SegmentAudio,
    SegmentDone,
    SegmentedSpeech,
    SentenceSplitter,
)

pytestmark = pytest.mark.timeout(30)


def test_sentences_end_at_punctuation_followed_by_space() -> None:
    splitter = SentenceSplitter()
    assert splitter.push("Hello there. How") == ["Hello there."]
    assert splitter.push(" are you? Pi is 3.") == ["How are you?"]
    assert splitter.push("14 (roughly") == []  # "3." then "14": not a sentence end
    assert splitter.push('!) "Done." Next') == ["Pi is 3.14 (roughly!)", '"Done."']
    assert splitter.flush() == "Next" and splitter.flush() is None


@given(st.lists(st.text(alphabet="ab .!?\n", max_size=12), max_size=8))
def test_segments_keep_every_word_in_order(pieces: list[str]) -> None:
    splitter = SentenceSplitter()
    segments = [s for piece in pieces for s in splitter.push(piece)]
    if (rest := splitter.flush()) is not None:
        segments.append(rest)
    assert all(s == s.strip() and s for s in segments)
    assert " ".join(segments).split() == "".join(pieces).split()


@pytest.mark.anyio
async def test_segments_are_spoken_in_order_and_cancel_drops_the_queue() -> None:
    started: list[str] = []
    closed: list[str] = []
    gate = anyio.Event()

    async def speak(text: str) -> AsyncGenerator[AudioChunk, None]:
        started.append(text)
        try:
            for _ in range(2):
                yield AudioChunk(torch.zeros(4), 24_000)
                if text == "long":
                    await gate.wait()
        finally:
            closed.append(text)

    speech = SegmentedSpeech(speak)
    events: list[SegmentAudio | SegmentDone] = []

    async def emit(event: SegmentAudio | SegmentDone) -> None:
        events.append(event)
        if isinstance(event, SegmentAudio) and event.segment == 1:
            speech.cancel()  # while "long" speaks: it and the queued "dropped" go

    for text in ("first", "long", "dropped"):
        speech.queue(text)
    async with anyio.create_task_group() as tg:
        tg.start_soon(speech.run, emit)
        await anyio.wait_all_tasks_blocked()
        assert speech.queue("after") == 3
        speech.end_input()
    assert started == ["first", "long", "after"] and closed == started
    done = [e.segment for e in events if isinstance(e, SegmentDone)]
    assert done == [0, 3]
    assert [e.segment for e in events if isinstance(e, SegmentAudio)] == [0, 0, 1, 3, 3]
