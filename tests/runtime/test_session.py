"""Speech sessions: text cut into segments, voiced in order, tagged, closed without leftovers."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.errors import RequestCancelled, RequestError, SessionClosed
from mstar_async.graph import Node, Walk
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, TextDelta
from mstar_async.runtime import Runtime, open_runtime, split_sentences
from tests.conductor.helpers import make_model, t
from tests.runtime.helpers import SPEECH, one_torch_thread, settled_tasks, tiny_lm


def test_split_sentences_cuts_after_complete_sentences_only() -> None:
    assert split_sentences("Hi there. How are") == (["Hi there."], " How are")
    assert split_sentences("Pi is 3.14! Really?\nYes") == (["Pi is 3.14!", "Really?"], "Yes")
    assert split_sentences('He said "stop." Then') == (['He said "stop."'], " Then")
    assert split_sentences("Wait...") == ([], "Wait...")  # "..." may go on: no cut yet
    assert split_sentences("你好。再见") == (["你好。"], "再见")


@settings(max_examples=200, deadline=None, database=None)
@given(st.text(alphabet=st.sampled_from('ab .!?\n3"。'), max_size=60))
def test_split_sentences_keeps_every_character_but_whitespace(text: str) -> None:
    sentences, rest = split_sentences(text)
    assert all(s and s == s.strip() for s in sentences)
    assert "".join("".join([*sentences, rest]).split()) == "".join(text.split())


async def _alone(runtime: Runtime, text: str) -> list[torch.Tensor]:
    async with runtime.generate(text=text, **SPEECH) as outputs:
        return [item.pcm async for item in outputs]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_segments_are_voiced_in_order_and_tagged() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with anyio.fail_after(40):
            expected = {
                k: await _alone(runtime, text)
                for k, text in enumerate(["Hello there.", "How are you?", "Fine"])
            }
            received: list[AudioChunk] = []
            async with runtime.speech_session(**SPEECH) as session:
                session.push_text("Hello there. How")
                assert session.segments == ["Hello there."]
                session.push_text(" are you? Fi")
                session.push_text("ne")
                session.end_input()
                session.end_input()  # again: nothing happens
                with pytest.raises(SessionClosed, match="after end_input"):
                    session.push_text("more")
                async for item in session:
                    received.append(item)
            assert session.segments == ["Hello there.", "How are you?", "Fine"]
    segments = [chunk.segment for chunk in received]
    assert segments == sorted(segments) and set(segments) == {0, 1, 2}
    for k, pcms in expected.items():
        got = [chunk.pcm for chunk in received if chunk.segment == k]
        assert len(got) == len(pcms) and all(
            torch.equal(a, b) for a, b in zip(got, pcms, strict=True)
        )
    assert [m.finished for m in session.metrics] == [True] * 3
    assert all(m.audio_seconds > 0 for m in session.metrics)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_flush_cuts_a_segment_and_the_next_segment_starts_ahead() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with anyio.fail_after(40):
            async with runtime.speech_session(lookahead=1, **SPEECH) as session:
                session.push_text("no sentence end")
                assert session.segments == []
                session.flush()
                session.push_text("Second. Third. Fourth.")
                session.flush()
                # The one being read and one ahead have started; the rest wait their turn.
                assert [s.request_id for s in session._streams] == [
                    f"{session.session_id}.0",
                    f"{session.session_id}.1",
                ]
                first = await session.__anext__()
                assert first.segment == 0
                session.end_input()
                rest = [item.segment async for item in session]
    assert session.segments == ["no sentence end", "Second.", "Third.", "Fourth."]
    assert rest == sorted(rest) and rest[-1] == 3


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_reading_waits_for_text_pushed_from_another_task() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with anyio.fail_after(40):
            async with runtime.speech_session(**SPEECH) as session:
                got: list[int] = []

                async def read() -> None:
                    async for item in session:
                        got.append(item.segment)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(read)
                    await anyio.wait_all_tasks_blocked()
                    session.push_text("One. ")
                    session.push_text("Two.")
                    await anyio.wait_all_tasks_blocked()
                    session.end_input()
    assert got and sorted(set(got)) == [0, 1] and got == sorted(got)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_model_without_the_text_input_is_refused() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with pytest.raises(RequestError, match="does not take 'prompt'"):
            runtime.speech_session(text_input="prompt")
        with pytest.raises(ValueError, match="lookahead"):
            runtime.speech_session(lookahead=-1)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_cancelling_the_reader_stops_every_segment_and_frees_kv(tiny_folder: Path) -> None:
    inputs: dict[str, Any] = {"max_tokens": 400, "ignore_eos": True}
    with one_torch_thread(), anyio.fail_after(40):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            baseline = await settled_tasks()
            engine = runtime.batching.engines["lm"]
            deltas: list[TextDelta] = []
            with anyio.CancelScope() as scope:
                async with runtime.speech_session(
                    text_input="prompt", lookahead=2, **inputs
                ) as session:
                    session.push_text("The capital of France is. def main(): we'll see. A. B. ")
                    async for delta in session:
                        assert isinstance(delta, TextDelta)
                        deltas.append(delta)
                        if len(deltas) == 3:
                            assert engine.blocks_in_use > 0
                            scope.cancel()
            assert scope.cancelled_caught
            assert {d.segment for d in deltas} == {0}
            assert engine.blocks_in_use == 0
            assert (await runtime.stats()).conductor.requests == 0
            assert [m.cancelled for m in session.metrics] == [True] * 3  # 1 read + 2 ahead
            assert await settled_tasks() == baseline
            with pytest.raises(SessionClosed, match="after aclose"):
                session.push_text("late")


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_text_segments_of_a_text_model_match_each_request_alone(tiny_folder: Path) -> None:
    sentences = ["The capital of France is.", "def main():", "we'll see"]
    with one_torch_thread(), anyio.fail_after(40):
        async with open_runtime(tiny_lm(tiny_folder)) as runtime:
            alone = []
            for sentence in sentences:
                async with runtime.generate(prompt=sentence, max_tokens=6) as outputs:
                    alone.append(
                        "".join([d.text async for d in outputs if isinstance(d, TextDelta)])
                    )
            by_segment: dict[int, str] = {}
            async with runtime.speech_session(text_input="prompt", max_tokens=6) as session:
                session.push_text("The capital of France is. def main():\nwe'll")
                session.push_text(" see")
                session.end_input()
                async for delta in session:
                    if not isinstance(delta, TextDelta):
                        continue  # a closing usage report, where the model makes one
                    by_segment[delta.segment] = by_segment.get(delta.segment, "") + delta.text
            assert session.segments == sentences
            assert (await runtime.stats()).ranks[0].kv_used == 0
    assert [by_segment[k] for k in range(3)] == alone


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_failing_segment_fails_the_session_and_stops_the_others() -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, text: str) -> AsyncGenerator[Any, None]:
        if text == "Bad.":
            raise ValueError("cannot say that")
        yield TextDelta(text)
        if text == "Later.":
            await anyio.sleep_forever()  # still running when the session fails
        yield TextDelta(str(float((await request.run("w", x=t(1)))["y"])))

    model = make_model([node], [Walk("w", "a")], program, {"inc": lambda x: {"y": x + 1}})
    async with open_runtime(model) as runtime:
        with anyio.fail_after(20):
            async with runtime.speech_session(lookahead=2) as session:
                session.push_text("Fine. Bad. Later. ")
                assert await session.__anext__() == TextDelta("Fine.", segment=0)
                assert await session.__anext__() == TextDelta("2.0", segment=0)
                with pytest.raises(RequestError, match="cannot say that") as caught:
                    await session.__anext__()
                assert not isinstance(caught.value, RequestCancelled)
                with pytest.raises(SessionClosed):
                    session.push_text("more")
                assert [item async for item in session] == []
            assert (await runtime.stats()).conductor.requests == 0
            assert [(m.finished, m.failed, m.cancelled) for m in session.metrics] == [
                (True, False, False),
                (False, True, False),
                (False, False, True),
            ]
