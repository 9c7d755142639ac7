"""Pipecat's own ``OpenAIRealtimeLLMService`` in a real Pipecat pipeline, pointed at
``/v1/realtime`` on a live server of the tiny qwen3-omni: text turns the way a Pipecat app makes
them (a context and ``LLMRunFrame``, then ``LLMMessagesAppendFrame``) come back as the reply's
audio and transcript frames; spoken user audio (``InputAudioRawFrame`` at Pipecat's 16 kHz)
fires the server's VAD, which Pipecat turns into user started/stopped speaking frames and an
interruption."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pipecat", reason="needs the voice extra: pip install 'mstar-async[voice]'")

from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMMessagesAppendFrame,
    LLMRunFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner
from starlette.applications import Starlette

from mstar_async.models import build_model
from mstar_async.server.app import create_app
from mstar_async.server.served import ModelSpec
from tests.realtime.audio import pcm16, sentence, with_silence
from tests.realtime.blocks import settled_request_blocks
from tests.server.live import live_server

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]

PIPECAT_RATE = 16_000  # PipelineParams' default audio_in_sample_rate
PIECE = PIPECAT_RATE // 50  # a transport's 20 ms input frames
REPLY_TOKENS = 6


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, Starlette]]:
    app = create_app([ModelSpec(build_model("qwen3-omni"))], max_concurrent=4)
    with live_server(app) as url:
        yield url, app


class Recorder(FrameProcessor):
    """Keeps every frame passing in ``direction``, with its arrival time."""

    def __init__(self, direction: FrameDirection) -> None:
        super().__init__()
        self.direction = direction
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self.direction:
            self.frames.append((time.perf_counter(), frame))
        await self.push_frame(frame, direction)

    def of(self, kind: type[Frame]) -> list[Any]:
        return [f for _, f in self.frames if isinstance(f, kind)]

    def when(self, kind: type[Frame], nth: int = 0) -> float:
        return [t for t, f in self.frames if isinstance(f, kind)][nth]

    async def wait_for(self, kind: type[Frame], count: int = 1) -> None:
        """Until ``count`` frames of ``kind`` have passed (polled, 60 s at most)."""
        async with asyncio.timeout(60):
            while len(self.of(kind)) < count:  # noqa: ASYNC110 (frames are appended, no event)
                await asyncio.sleep(0.01)


class Typed(FrameProcessor):
    """Where an app's typed text enters, between the user aggregator and the service: Pipecat's
    user aggregator keeps an ``LLMMessagesAppendFrame`` for itself (pushing the context
    downstream, which the realtime service does not answer), so text meant for the realtime
    service is pushed past it, as the service's ``_handle_messages_append`` expects."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)

    async def say(self, text: str) -> None:
        turn = {"role": "user", "content": text}
        await self.push_frame(LLMMessagesAppendFrame([turn], run_llm=True))


def service(url: str) -> OpenAIRealtimeLLMService:
    return OpenAIRealtimeLLMService(
        api_key="unused",
        base_url=url.replace("http", "ws", 1) + "/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(
            model="qwen3-omni",
            system_instruction="Answer in one short sentence.",
            session_properties=events.SessionProperties(max_output_tokens=REPLY_TOKENS),
        ),
    )


async def test_text_turns_come_back_as_audio_and_transcript_frames(
    live: tuple[str, Starlette],
) -> None:
    url, app = live
    llm = service(url)
    context = LLMContext([{"role": "user", "content": "Tell me a story"}])
    pair = LLMContextAggregatorPair(context)
    typed = Typed()
    out = Recorder(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(
        Pipeline([pair.user(), typed, llm, out, pair.assistant()]),
        params=PipelineParams(),
        enable_rtvi=False,
        idle_timeout_secs=None,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    try:
        await worker.queue_frame(LLMRunFrame())
        await out.wait_for(LLMFullResponseEndFrame)
        first_audio = out.of(TTSAudioRawFrame)
        first_text = "".join(f.text for f in out.of(TTSTextFrame))
        await typed.say("And then?")
        await out.wait_for(LLMFullResponseEndFrame, count=2)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, timeout=30)
    finally:
        if not running.done():
            await worker.cancel()
            await running
    audio = out.of(TTSAudioRawFrame)
    assert first_audio and {(f.sample_rate, f.num_channels) for f in audio} == {(24_000, 1)}
    # One TTSStoppedFrame a reply; Pipecat opens its audio context (TTSStartedFrame) again
    # only after an output transport's BotStoppedSpeakingFrame, and this pipeline has none.
    assert len(out.of(TTSStoppedFrame)) == 2 and len(out.of(TTSStartedFrame)) == 1
    assert out.when(TTSStartedFrame) < out.when(TTSAudioRawFrame)
    assert first_text.strip()  # the transcript of the spoken reply, as Pipecat shows it
    second = [f for t, f in out.frames if t > out.when(LLMFullResponseEndFrame, 0)]
    assert any(isinstance(f, TTSAudioRawFrame) for f in second)
    assert any(isinstance(f, TTSTextFrame) for f in second)
    assert sum(len(f.audio) for f in audio) % 2 == 0
    # Both replies and the user turns are in Pipecat's context, in order.
    roles = [m["role"] for m in context.get_messages() if isinstance(m, dict)]
    assert roles[:2] == ["user", "assistant"] and roles.count("assistant") == 2
    assert await settled_request_blocks(app.state.server.models["qwen3-omni"].runtime) == 0


async def test_spoken_user_audio_fires_server_vad_and_gets_a_spoken_reply(
    live: tuple[str, Starlette],
) -> None:
    url, _ = live
    llm = service(url)
    items: list[Any] = []

    @llm.event_handler("on_conversation_item_created")  # type: ignore[untyped-decorator]
    async def on_item(service: Any, item_id: str, item: Any) -> None:
        items.append(item)

    pair = LLMContextAggregatorPair(LLMContext())
    up = Recorder(FrameDirection.UPSTREAM)  # errors the service reports travel upstream
    out = Recorder(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(
        Pipeline([pair.user(), up, llm, out, pair.assistant()]),
        params=PipelineParams(),
        enable_rtvi=False,
        idle_timeout_secs=None,
    )
    speech = sentence("weather", PIPECAT_RATE)
    data = pcm16(with_silence(speech, 0.5, 1.2, PIPECAT_RATE))
    frames = [
        InputAudioRawFrame(audio=data[i : i + 2 * PIECE], sample_rate=PIPECAT_RATE, num_channels=1)
        for i in range(0, len(data), 2 * PIECE)
    ]
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    try:
        await worker.queue_frames(frames)
        await out.wait_for(UserStoppedSpeakingFrame)
        # The server commits the turn and answers it: the model hears the speech and replies
        # with speech, as to a typed turn.
        await out.wait_for(LLMFullResponseEndFrame)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, timeout=30)
    finally:
        if not running.done():
            await worker.cancel()
            await running
    started = out.when(UserStartedSpeakingFrame)
    assert started < out.when(InterruptionFrame) < out.when(UserStoppedSpeakingFrame)
    assert len(out.of(UserStartedSpeakingFrame)) == len(out.of(UserStoppedSpeakingFrame)) == 1
    assert not up.of(ErrorFrame)
    assert out.when(UserStoppedSpeakingFrame) < out.when(TTSAudioRawFrame)
    assert "".join(f.text for f in out.of(TTSTextFrame)).strip()
    user = [i for i in items if getattr(i, "role", None) == "user"]
    assert len(user) == 1 and user[0].content[0].type == "input_audio"
