"""LiveKit Agents' OpenAI plugin (``livekit.plugins.openai.realtime.RealtimeModel``) driven
directly, without a LiveKit room, against ``/v1/realtime`` on a live server of the tiny
qwen3-omni: a text turn put in through the session's chat context and ``generate_reply``
comes back as the reply's text and audio frames; spoken audio pushed with ``push_audio`` fires
the server's VAD and its turn; a voice the model lacks is refused at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

pytest.importorskip("livekit.plugins.openai", reason="needs livekit-plugins-openai (test extra)")

from livekit import rtc
from livekit.agents import llm
from livekit.plugins.openai.realtime import RealtimeModel, RealtimeSession
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad
from starlette.applications import Starlette

from mstar_async.models import build_model
from mstar_async.server.app import create_app
from mstar_async.server.served import ModelSpec
from tests.realtime.audio import CLIENT_RATE, pcm16, sentence, with_silence
from tests.realtime.blocks import settled_request_blocks
from tests.server.live import live_server

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]

PIECE = CLIENT_RATE // 50  # 20 ms frames, as a room's audio track delivers them


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, Starlette]]:
    app = create_app([ModelSpec(build_model("qwen3-omni"))], max_concurrent=4)
    with live_server(app) as url:
        yield url, app


async def settled_kv_blocks(app: Starlette) -> int:
    """Blocks of requests once the sessions have ended (see ``settled_request_blocks``)."""
    return await settled_request_blocks(app.state.server.models["qwen3-omni"].runtime)


class Seen:
    """The session's events by name, in order."""

    def __init__(self, session: RealtimeSession) -> None:
        self.events: list[tuple[str, Any]] = []
        for name in (
            "error",
            "input_speech_started",
            "input_speech_stopped",
            "generation_created",
            "remote_item_added",
        ):
            session.on(name, lambda event, name=name: self.events.append((name, event)))
        self.outcomes: list[BaseException | None] = []

        def generation_created(event: Any) -> None:
            # The plugin ends a failed response's generation with an exception on a private
            # future nothing of LiveKit's awaits (asyncio would report it as never retrieved
            # when it is collected); keep it here, where the tests can see it.
            done = session._current_generation._done_fut  # type: ignore[union-attr]
            done.add_done_callback(lambda fut: self.outcomes.append(fut.exception()))

        session.on("generation_created", generation_created)

    def of(self, name: str) -> list[Any]:
        return [event for seen, event in self.events if seen == name]

    async def wait_for(self, name: str) -> Any:
        async with asyncio.timeout(60):
            while not self.of(name):  # noqa: ASYNC110 (the emitter's callbacks append)
                await asyncio.sleep(0.01)
        return self.of(name)[0]


@asynccontextmanager
async def session(url: str, **options: Any) -> AsyncIterator[tuple[RealtimeSession, Seen]]:
    model = RealtimeModel(
        base_url=f"{url}/v1",
        api_key="unused",
        model="qwen3-omni",
        input_audio_transcription=None,  # not served
        **options,
    )
    model.update_options(max_response_output_tokens=6)
    realtime = model.session()
    seen = Seen(realtime)
    try:
        yield realtime, seen
    finally:
        await realtime.aclose()
        await model.aclose()


async def reply_of(generation: llm.GenerationCreatedEvent) -> tuple[str, list[rtc.AudioFrame]]:
    """The reply's text and audio frames, read as an agent reads them."""
    texts: list[str] = []
    frames: list[rtc.AudioFrame] = []
    async with asyncio.timeout(60):
        async for message in generation.message_stream:

            async def text(stream: AsyncIterator[str] = message.text_stream) -> None:
                texts.extend([piece async for piece in stream])

            async def audio(stream: AsyncIterator[rtc.AudioFrame] = message.audio_stream) -> None:
                frames.extend([frame async for frame in stream])

            await asyncio.gather(text(), audio())
            assert await message.modalities == ["audio", "text"]
    return "".join(texts), frames


async def test_a_chat_context_turn_comes_back_as_text_and_audio_frames(
    live: tuple[str, Starlette],
) -> None:
    url, app = live
    detection = ServerVad(type="server_vad", create_response=False, interrupt_response=False)
    async with session(url, voice="ethan", turn_detection=detection) as (realtime, seen):
        await realtime.update_instructions("Answer in one short sentence.")
        context = llm.ChatContext()
        context.add_message(role="user", content="Tell me a story")
        await realtime.update_chat_ctx(context)  # waits for the server to add the item
        generation = await asyncio.wait_for(realtime.generate_reply(), 20)
        text, frames = await reply_of(generation)
        # The second turn, as an agent adds one: the updated context, then a reply.
        context = realtime.chat_ctx.copy()
        context.add_message(role="user", content="And then?")
        await realtime.update_chat_ctx(context)
        second = await asyncio.wait_for(realtime.generate_reply(), 20)
        second_text, second_frames = await reply_of(second)
        remote = realtime.chat_ctx.items
    assert seen.of("error") == []
    assert generation.user_initiated and second.user_initiated  # matched by response metadata
    assert text.strip() and second_text.strip()
    assert frames and second_frames
    assert {(f.sample_rate, f.num_channels) for f in frames + second_frames} == {(CLIENT_RATE, 1)}
    assert sum(f.samples_per_channel for f in frames) > CLIENT_RATE // 10
    # The remote context mirrors the server's conversation: both turns and both replies.
    roles = [item.role for item in remote if item.type == "message"]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert remote[1].text_content == text
    assert await settled_kv_blocks(app) == 0


async def test_pushed_audio_fires_server_vad_and_the_turn_gets_a_spoken_reply(
    live: tuple[str, Starlette],
) -> None:
    url, app = live
    detection = ServerVad(type="server_vad", silence_duration_ms=500)  # creates responses
    async with session(url, voice="ethan", turn_detection=detection) as (realtime, seen):
        spoken = sentence("weather")
        data = pcm16(with_silence(spoken, 0.6, 1.0, CLIENT_RATE))
        for start in range(0, len(data), 2 * PIECE):
            piece = data[start : start + 2 * PIECE]
            realtime.push_audio(
                rtc.AudioFrame(
                    piece, CLIENT_RATE, num_channels=1, samples_per_channel=len(piece) // 2
                )
            )
        await seen.wait_for("input_speech_stopped")
        # The server commits the turn and answers it: the model hears the speech.
        generation = await seen.wait_for("generation_created")
        text, frames = await reply_of(generation)
    kinds = [name for name, _ in seen.events if name.startswith("input_speech")]
    assert kinds == ["input_speech_started", "input_speech_stopped"]
    (user,) = [e.item for e in seen.of("remote_item_added") if e.item.role == "user"]
    assert user.type == "message"
    assert not generation.user_initiated  # the server's response
    assert seen.of("error") == []
    assert text.strip() and frames
    assert await settled_kv_blocks(app) == 0


async def test_a_voice_the_model_lacks_is_refused_when_the_session_is_set_up(
    live: tuple[str, Starlette],
) -> None:
    url, _ = live
    # LiveKit's default voice is OpenAI's "marin"; qwen3-omni speaks as ethan or chelsie.
    async with session(url, turn_detection=None) as (_, seen):
        error = await seen.wait_for("error")
    body = error.error.body
    assert body.param == "audio.output.voice" and "ethan" in body.message
    assert error.recoverable
