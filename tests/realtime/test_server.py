"""``/v1/realtime`` through the official ``openai`` realtime client (and a raw websocket for the
beta dialect) against a live server of the tiny qwen3-omni: spoken replies, server VAD on
spoken fixtures, barge-in, truncation, and an error event for every bad client event."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
import websockets
from openai import AsyncOpenAI
from starlette.applications import Starlette

from mstar_async.models import build_model
from mstar_async.server.app import create_app
from mstar_async.server.served import ModelSpec
from tests.realtime.audio import CLIENT_RATE, pcm16, sentence, with_silence
from tests.realtime.blocks import request_blocks, settled_request_blocks
from tests.server.live import live_server

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]

TEXT_TURN = {
    "type": "message",
    "role": "user",
    "content": [{"type": "input_text", "text": "Tell me a story"}],
}
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
PIECE = CLIENT_RATE // 50  # 20 ms of client audio per append


@dataclass
class Live:
    url: str
    app: Starlette

    def kv_blocks(self) -> int:
        """Every KV block in use, kept conversations' included."""
        return int(self.app.state.server.models["qwen3-omni"].runtime.batching.kv_blocks_in_use)

    def thinker(self) -> Any:
        return self.app.state.server.models["qwen3-omni"].runtime.batching.engines["thinker"]

    def request_blocks(self) -> int:
        """KV blocks of requests, beyond what the sessions' conversations keep."""
        return request_blocks(self.app.state.server.models["qwen3-omni"].runtime)

    async def settled_request_blocks(self) -> int:
        """``request_blocks`` once the sessions have ended (``blocks.settled_request_blocks``)."""
        return await settled_request_blocks(self.app.state.server.models["qwen3-omni"].runtime)

    async def all_released(self) -> None:
        """Wait (10 s at most) until no request, walk, KV block (kept conversations' too) or
        VAD stream of any session is left: what closing every socket must come to."""
        served = self.app.state.server.models["qwen3-omni"]
        vad = self.app.state.server.vad
        assert vad is not None
        with anyio.fail_after(10):
            while (  # noqa: ASYNC110  (other threads' and engines' counts: no event)
                self.kv_blocks()
                or served.admission.in_flight
                or served.runtime.conductor.active
                or served.runtime.batching.walks_running
                or vad.batching.walks_running
                or vad.batching.engines["vad"].streams
                or vad.conductor.active
            ):
                await anyio.sleep(0.02)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    app = create_app([ModelSpec(build_model("qwen3-omni"))], max_concurrent=4)
    with live_server(app) as url:
        yield Live(url, app)


@asynccontextmanager
async def connect(live: Live) -> AsyncIterator[Any]:
    client = AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model="qwen3-omni") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        yield conn


async def until(conn: Any, kind: str, seen: list[Any] | None = None) -> Any:
    """Events up to the first of ``kind`` (kept in ``seen``); that event."""
    with anyio.fail_after(90):
        async for event in conn:
            if seen is not None:
                seen.append(event)
            if event.type == kind:
                return event
    raise AssertionError(f"the connection ended before {kind}")


async def send_audio(conn: Any, audio: np.ndarray) -> None:
    data = pcm16(audio)
    step = PIECE * 2
    for start in range(0, len(data), step):
        await conn.input_audio_buffer.append(
            audio=base64.b64encode(data[start : start + step]).decode()
        )


async def test_a_text_turn_gets_a_spoken_reply_with_its_transcript(live: Live) -> None:
    async with connect(live) as conn:
        await conn.session.update(session={**MANUAL, "instructions": "Be brief."})
        await until(conn, "session.updated")
        await conn.conversation.item.create(item=TEXT_TURN)
        added = await until(conn, "conversation.item.added")
        await until(conn, "conversation.item.done")
        await conn.response.create(response={"max_output_tokens": 16})
        seen: list[Any] = []
        done = await until(conn, "response.done", seen)
    kinds = [e.type for e in seen]
    audio = b"".join(
        base64.b64decode(e.delta) for e in seen if e.type == "response.output_audio.delta"
    )
    transcript = "".join(
        e.delta for e in seen if e.type == "response.output_audio_transcript.delta"
    )
    assert kinds[0] == "response.created"
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added")
    assert kinds.index("response.content_part.added") < kinds.index("response.output_audio.delta")
    assert kinds[-6:-1] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
    ]
    assert done.response.status == "completed"
    (message,) = done.response.output
    assert message.role == "assistant" and message.content[0].transcript == transcript
    assert transcript and len(audio) > CLIENT_RATE // 5 and len(audio) % 2 == 0
    item_added = next(e for e in seen if e.type == "conversation.item.added")
    assert item_added.previous_item_id == added.item.id
    assert await live.settled_request_blocks() == 0


async def test_the_beta_dialect_gets_the_beta_event_names(live: Live) -> None:
    url = live.url.replace("http", "ws") + "/v1/realtime?model=qwen3-omni"
    headers = {"OpenAI-Beta": "realtime=v1", "Authorization": "Bearer unused"}
    async with websockets.connect(url, additional_headers=headers) as ws:
        events = [
            {"type": "session.update", "session": {"modalities": ["text"], "turn_detection": None}},
            {"type": "conversation.item.create", "item": TEXT_TURN},
            {"type": "response.create", "response": {"max_response_output_tokens": 8}},
        ]
        for event in events:
            await ws.send(json.dumps(event))
        kinds = []
        with anyio.fail_after(60):
            while not kinds or kinds[-1] != "response.done":
                kinds.append(json.loads(await ws.recv())["type"])
    assert "conversation.item.created" in kinds and "conversation.item.added" not in kinds
    assert "response.text.delta" in kinds and "response.text.done" in kinds
    assert not any("output_audio" in k or "output_text" in k for k in kinds)


async def test_server_vad_finds_the_spoken_turn_and_commits_it(live: Live) -> None:
    spoken = sentence("weather")
    audio = with_silence(spoken, 0.6, 1.0, CLIENT_RATE)
    async with connect(live) as conn:
        detection = {"type": "server_vad", "create_response": False, "silence_duration_ms": 500}
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        )
        await until(conn, "session.updated")
        await send_audio(conn, audio)
        seen: list[Any] = []
        committed = await until(conn, "input_audio_buffer.committed", seen)
        item = await until(conn, "conversation.item.added")
    started = next(e for e in seen if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    speech_end_ms = 1000 * (0.6 + len(spoken) / CLIENT_RATE)
    assert 0 <= started.audio_start_ms <= 600  # the speech starts at 600 ms, 300 ms padding
    assert speech_end_ms + 400 <= stopped.audio_end_ms <= speech_end_ms + 900
    assert started.item_id == stopped.item_id == committed.item_id == item.item.id
    assert item.item.role == "user" and item.item.content[0].type == "input_audio"


async def test_speaking_over_a_reply_cancels_it_and_frees_its_memory(live: Live) -> None:
    async with connect(live) as conn:
        detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        )
        await until(conn, "session.updated")
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 200})
        await until(conn, "response.output_audio.delta")
        await send_audio(conn, with_silence(sentence("stop"), 0.2, 0.0, CLIENT_RATE))
        await until(conn, "input_audio_buffer.speech_started")
        heard = time.perf_counter()
        done = await until(conn, "response.done")
        cancel_s = time.perf_counter() - heard
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "turn_detected"
        assert await live.settled_request_blocks() == 0
        print(f"barge-in: speech_started to response.done {cancel_s * 1000:.0f} ms")
        # The session goes on: a new turn gets a reply.
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 4, "output_modalities": ["text"]})
        assert (await until(conn, "response.done")).response.status == "completed"


def new_conversation(live: Live, before: set[str]) -> str:
    """The handle of the one conversation kept since ``before`` (the handles then)."""
    handles = live.thinker().handles
    (name,) = [n for n in handles if n.startswith("conversation:") and n not in before]
    return name


async def test_truncating_a_reply_cuts_its_text_where_playback_stopped(live: Live) -> None:
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 24})
        done = await until(conn, "response.done")
        message = done.response.output[0]
        full = message.content[0].transcript
        await conn.conversation.item.truncate(item_id=message.id, content_index=0, audio_end_ms=0)
        truncated = await until(conn, "conversation.item.truncated")
        assert truncated.item_id == message.id and truncated.audio_end_ms == 0
        await conn.conversation.item.truncate(
            item_id=message.id, content_index=0, audio_end_ms=10**6
        )
        error = await until(conn, "error")
        assert error.error.param == "audio_end_ms"
    assert full  # the reply said something; nothing of it was heard at 0 ms


async def test_a_changed_conversation_rolls_the_kept_kv_back_to_the_change(live: Live) -> None:
    before = set(live.thinker().handles)
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(
            response={"max_output_tokens": 12, "output_modalities": ["text"]}
        )
        reply = (await until(conn, "response.done")).response.output[0]
        kept = live.thinker().handles[new_conversation(live, before)][1]
        # The reply is gone from the conversation: the next turn may reuse the kept KV up to
        # where the reply began, and none of the reply's 11 fed-back tokens.
        await conn.conversation.item.delete(item_id=reply.id)
        await until(conn, "conversation.item.deleted")
        # Rolled back as the item went, not at the next response.
        name = new_conversation(live, before)
        assert await settled(lambda: live.thinker().handles[name][1] <= kept - 11)
        rewound = live.thinker().handles[name][1]
        reused = live.thinker().reused_tokens
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
        assert (await until(conn, "response.done")).response.status == "completed"
        rolled_back = live.thinker().reused_tokens - reused
    assert 0 < rolled_back == rewound


async def settled(holds: Callable[[], bool]) -> bool:
    """Whether ``holds()`` comes true within 10 s (polled: the server's own loop and threads
    change the counts it reads)."""
    with anyio.move_on_after(10):
        while not holds():  # noqa: ASYNC110  (engine counts: no event to wait on)
            await anyio.sleep(0.01)
    return holds()


async def no_other_conversations(live: Live) -> None:
    """Wait until earlier tests' sessions have freed what they kept, so this test's counts
    are its own."""
    assert await settled(lambda: not live.kv_blocks())


async def test_truncating_a_reply_gives_its_kv_back_at_the_event(live: Live) -> None:
    await no_other_conversations(live)
    thinker = live.thinker()
    before = set(thinker.handles)
    async with connect(live) as conn:
        await conn.session.update(session={**MANUAL, "temperature": 0})
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 200})
        done = await until(conn, "response.done")
        message = done.response.output[0]
        full = message.content[0].transcript
        name = new_conversation(live, before)
        kept, blocks = thinker.handles[name][1], thinker.blocks_in_use
        # The user heard none of the speech: the tiny model had written the first ~200 of the
        # transcript's ~1,400 characters when its first audio was made, and keeps those.
        await conn.conversation.item.truncate(item_id=message.id, content_index=0, audio_end_ms=0)
        await until(conn, "conversation.item.truncated")
        assert await settled(lambda: thinker.blocks_in_use < blocks)
        rewound = thinker.handles[name][1]
        assert 0 < rewound < kept - 64
        assert blocks - thinker.blocks_in_use == -(-kept // 16) - -(-rewound // 16)
        await conn.conversation.item.retrieve(item_id=message.id)
        heard = (await until(conn, "conversation.item.retrieved")).item.content[0].transcript
        assert 0 < len(heard) < len(full) // 2
        # The next turn starts from exactly what the truncate kept, and answers as a session
        # that was told the cut conversation from the start.
        reused = thinker.reused_tokens
        await conn.conversation.item.create(item=TEXT_TURN)
        answer = await text_reply(conn)
        assert thinker.reused_tokens - reused == rewound
    async with connect(live) as fresh:
        await fresh.session.update(session={**MANUAL, "temperature": 0})
        assistant = {"type": "output_text", "text": heard}
        for item in (TEXT_TURN, {"type": "message", "role": "assistant", "content": [assistant]}):
            await fresh.conversation.item.create(item=item)
        await fresh.conversation.item.create(item=TEXT_TURN)
        assert answer == await text_reply(fresh)
    await live.all_released()


async def test_truncating_the_reply_being_played_stops_it_then_cuts_it(live: Live) -> None:
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 200})
        delta = await until(conn, "response.output_audio.delta")
        await conn.conversation.item.truncate(
            item_id=delta.item_id, content_index=0, audio_end_ms=0
        )
        seen: list[Any] = []
        truncated = await until(conn, "conversation.item.truncated", seen)
        done = next(e for e in seen if e.type == "response.done")
        assert done.response.status == "cancelled" and truncated.item_id == delta.item_id
        assert not [e for e in seen if e.type == "error"]
    await live.all_released()


async def text_reply(conn: Any) -> str:
    """A text response to the conversation so far (8 tokens at most): its text."""
    await conn.response.create(response={"max_output_tokens": 8, "output_modalities": ["text"]})
    done = await until(conn, "response.done")
    assert done.response.status == "completed"
    return str(done.response.output[0].content[0].text)


BAD_EVENTS = [
    ({"type": "no.such.event"}, "unknown_event", "type"),
    (
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
        },
        "unsupported_value",
        "audio.input.format",
    ),
    (
        {
            "type": "session.update",
            "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
        },
        "unsupported_value",
        "audio.input.turn_detection",
    ),
    (
        {
            "type": "session.update",
            "session": {"audio": {"input": {"turn_detection": {"threshold": 2}}}},
        },
        "invalid_value",
        "audio.input.turn_detection.threshold",
    ),
    (
        {"type": "session.update", "session": {"output_modalities": ["video"]}},
        "invalid_value",
        "output_modalities",
    ),
    (
        {"type": "session.update", "session": {"max_output_tokens": 0}},
        "invalid_value",
        "max_output_tokens",
    ),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.append"}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
    (
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "robot", "content": []},
        },
        "invalid_value",
        "item.role",
    ),
    (
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_image"}]},
        },
        "invalid_value",
        "item.content[0]",
    ),
    (
        {"type": "conversation.item.create", "item": TEXT_TURN, "previous_item_id": "nope"},
        "item_not_found",
        "previous_item_id",
    ),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_not_found", "item_id"),
    (
        {"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 0},
        "item_not_found",
        "item_id",
    ),
    ({"type": "response.cancel"}, "response_cancel_not_active", None),
    (
        {"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}},
        "invalid_value",
        "audio.output.voice",
    ),
    (
        {"type": "session.update", "session": {"audio": {"output": {"speed": 1.5}}}},
        "unsupported_value",
        "audio.output.speed",
    ),
    (
        {"type": "session.update", "session": {"type": "transcription"}},
        "unsupported_value",
        "session.type",
    ),
    (
        {"type": "response.create", "response": {"conversation": "none"}},
        "unsupported_value",
        "response.conversation",
    ),
    (
        {"type": "response.create", "response": {"input": []}},
        "unsupported_value",
        "response.input",
    ),
    (
        {"type": "response.create", "response": {"metadata": {"k": 1}}},
        "invalid_value",
        "response.metadata",
    ),
    (
        {"type": "response.create", "response": {"audio": {"output": {"voice": "alloy"}}}},
        "invalid_value",
        "audio.output.voice",
    ),
    ({"type": "output_audio_buffer.clear"}, "unsupported_event", "type"),
    (
        {"type": "conversation.item.retrieve", "item_id": "nope"},
        "item_retrieve_invalid_item_id",
        "item_id",
    ),
    (
        {"type": "response.create", "response": {"max_output_tokens": "lots"}},
        "invalid_value",
        "max_output_tokens",
    ),
]


async def test_every_bad_event_gets_an_error_event_and_the_session_goes_on(live: Live) -> None:
    url = live.url.replace("http", "ws") + "/v1/realtime?model=qwen3-omni"
    async with websockets.connect(url) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for i, (event, code, param) in enumerate(BAD_EVENTS):
            await ws.send(json.dumps({**event, "event_id": f"bad{i}"}))
            with anyio.fail_after(30):
                reply = json.loads(await ws.recv())
            assert reply["type"] == "error", (event, reply)
            assert (reply["error"]["code"], reply["error"]["param"]) == (code, param), event
            assert reply["error"]["event_id"] == f"bad{i}"
        await ws.send("{not json")
        assert json.loads(await ws.recv())["error"]["code"] == "invalid_json"
        await ws.send(b"\x00binary")
        assert json.loads(await ws.recv())["type"] == "error"
        await ws.send(json.dumps({"type": "session.update", "session": MANUAL}))
        assert json.loads(await ws.recv())["type"] == "session.updated"
        await ws.send(json.dumps({"type": "conversation.item.create", "item": TEXT_TURN}))
        await ws.send(
            json.dumps(
                {
                    "type": "response.create",
                    "response": {"max_output_tokens": 4, "output_modalities": ["text"]},
                }
            )
        )
        kinds = []
        with anyio.fail_after(60):
            while not kinds or kinds[-1] != "response.done":
                kinds.append(json.loads(await ws.recv())["type"])
        assert "response.output_text.delta" in kinds


def heard(live: Live) -> tuple[float, float, float]:
    """Committed spoken turns so far: (count, seconds of speech, seconds the encoder had not
    convolved when their turns ended), from the server's metrics."""
    registry = live.app.state.server.metrics.registry
    labels = {"model": "qwen3-omni"}
    count = registry.get_sample_value("mstar_realtime_turn_audio_seconds_count", labels) or 0.0
    total = registry.get_sample_value("mstar_realtime_turn_audio_seconds_sum", labels) or 0.0
    left = registry.get_sample_value("mstar_realtime_turn_unheard_seconds_sum", labels) or 0.0
    return count, total, left


def rows_for(samples: int) -> int:
    """The audio encoder's rows for ``samples`` at 16 kHz (upstream's length formula)."""
    frames = samples // 160
    tail = frames % 100
    for _ in range(3):
        tail = (tail - 1) // 2 + 1 if tail else 0
    return frames // 100 * 13 + tail


async def test_committed_speech_is_heard_and_answered(live: Live) -> None:
    spoken = sentence("weather")
    before = heard(live)
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await send_audio(conn, spoken)
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
        await conn.response.create(response={"max_output_tokens": 8})
        seen: list[Any] = []
        done = await until(conn, "response.done", seen)
        # A typed turn after it: the conversation holds both.
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 1, "output_modalities": ["text"]})
        typed = await until(conn, "response.done")
    assert done.response.status == "completed", done.response.status_details
    transcript = "".join(
        e.delta for e in seen if e.type == "response.output_audio_transcript.delta"
    )
    assert transcript and any(e.type == "response.output_audio.delta" for e in seen)
    count, total, left = (a - b for a, b in zip(heard(live), before, strict=True))
    samples = round(total * 16_000)
    # 24 kHz in, 16 kHz heard: all but what soxr's filter still holds (a few hundred samples).
    assert count == 1 and 0 <= len(spoken) * 2 // 3 - samples < 400
    # Appends sent as fast as the client can: how much is left at the commit depends on how
    # far behind the encoder is (the VAD test below measures a turn's end).
    assert 0 <= left <= total
    assert typed.response.status == "completed"
    assert await live.settled_request_blocks() == 0


async def test_a_cleared_buffer_is_not_heard(live: Live) -> None:
    before = heard(live)
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await send_audio(conn, sentence("story"))
        await conn.input_audio_buffer.clear()
        await until(conn, "input_audio_buffer.cleared")
        stop = sentence("stop")
        await send_audio(conn, stop)
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
    count, total, _ = (a - b for a, b in zip(heard(live), before, strict=True))
    # One turn, of the audio after the clear only (less what soxr's filter still holds).
    assert count == 1 and 0 <= len(stop) * 2 // 3 - round(total * 16_000) < 400


async def test_a_conversation_item_with_audio_is_heard_and_answered(live: Live) -> None:
    audio = base64.b64encode(pcm16(sentence("stop"))).decode()
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": audio}],
            }
        )
        added = await until(conn, "conversation.item.added")
        await conn.response.create(response={"max_output_tokens": 6, "output_modalities": ["text"]})
        done = await until(conn, "response.done")
        # The item was encoded once, when created: the next turn reuses the kept KV of the
        # whole first turn, its audio rows included.
        reused = live.thinker().reused_tokens
        await conn.conversation.item.create(item=TEXT_TURN)
        await conn.response.create(response={"max_output_tokens": 2, "output_modalities": ["text"]})
        assert (await until(conn, "response.done")).response.status == "completed"
        rows = rows_for(len(sentence("stop")) * 2 // 3)
        assert live.thinker().reused_tokens - reused > rows + 5
        # Too long for an item: refused by its size, before it is decoded.
        long = "A" * (4 * 120 * CLIENT_RATE * 2 // 3 + 8)
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_audio", "audio": long}],
            }
        )
        error = await until(conn, "error")
    assert added.item.content[0].type == "input_audio"
    assert done.response.status == "completed" and done.response.output[0].content[0].text
    assert error.error.param == "item.content[0].audio" and "at most 120 s" in error.error.message
    assert await live.settled_request_blocks() == 0


async def test_an_unknown_model_closes_with_an_error(live: Live) -> None:
    url = live.url.replace("http", "ws") + "/v1/realtime?model=nope"
    async with websockets.connect(url) as ws:
        reply = json.loads(await ws.recv())
        assert reply["type"] == "error" and reply["error"]["param"] == "model"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()


async def test_fields_sent_as_null_are_unset_and_metadata_comes_back(live: Live) -> None:
    # Clients built on typed models (LiveKit's plugin, Pipecat's service) send every optional
    # field, null where unset: that is no change, not a bad value.
    async with connect(live) as conn:
        await conn.session.update(
            session={
                **MANUAL,
                "instructions": None,
                "tracing": None,
                "audio": {
                    "input": {"turn_detection": None, "transcription": None, "format": None},
                    "output": {"voice": "Chelsie", "speed": 1.0},
                },
            }
        )
        updated = await until(conn, "session.updated")
        assert updated.session.audio.output.voice == "chelsie"
        await conn.conversation.item.create(item=TEXT_TURN)
        added = await until(conn, "conversation.item.added")
        await conn.send(
            {
                "type": "response.create",
                "response": {
                    "instructions": None,
                    "tools": None,
                    "max_output_tokens": 4,
                    "output_modalities": ["text"],
                    "metadata": {"client_event_id": "turn-1"},
                },
            }
        )
        created = await until(conn, "response.created")
        done = await until(conn, "response.done")
        await conn.conversation.item.retrieve(item_id=added.item.id)
        retrieved = await until(conn, "conversation.item.retrieved")
    assert created.response.metadata == done.response.metadata == {"client_event_id": "turn-1"}
    assert done.response.status == "completed"
    assert retrieved.item.id == added.item.id
    assert retrieved.item.content[0].text == "Tell me a story"


async def test_a_vad_turn_is_encoded_while_spoken_and_answered(live: Live) -> None:
    spoken = sentence("weather")
    before = heard(live)
    async with connect(live) as conn:
        detection = {"type": "server_vad", "silence_duration_ms": 500}  # creates responses
        await conn.session.update(
            session={
                "type": "realtime",
                "max_output_tokens": 8,
                "audio": {"input": {"turn_detection": detection}},
            }
        )
        await until(conn, "session.updated")
        await send_audio(conn, with_silence(spoken, 0.6, 1.0, CLIENT_RATE))
        seen: list[Any] = []
        done = await until(conn, "response.done", seen)
    kinds = [e.type for e in seen]
    assert "error" not in kinds
    order = ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert kinds.index(order[0]) < kinds.index(order[1]) < kinds.index("response.created")
    assert done.response.status == "completed", done.response.status_details
    assert any(e.type == "response.output_audio.delta" for e in seen)
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    count, total, left = (a - b for a, b in zip(heard(live), before, strict=True))
    # The turn is the session's audio up to the stop: 2.6 s or more of speech and silence.
    assert count == 1 and round(total * 16_000) == stopped.audio_end_ms * 16
    assert total > 2.5
    # The encoder heard the turn as the VAD judged it: when the VAD said stop, every second
    # of it that closed 200 ms before (two 100 ms pieces of the encoder's input) was already
    # convolved, so what was left is the partial last second and at most one second that
    # closed just then.
    frames, left_frames = round(total * 100), round(left * 100)
    assert frames - left_frames >= (frames - 20) // 100 * 100 >= 200
    print(f"vad turn: {total:.2f} s of speech, {left:.2f} s left to encode at speech_stopped")


@pytest.fixture(scope="module")
def bounded() -> Iterator[str]:
    """A server admitting one request at a time, behind an API key."""
    app = create_app([ModelSpec(build_model("qwen3-omni"))], max_concurrent=1, api_key="sekret")
    with live_server(app) as url:
        yield url.replace("http", "ws", 1) + "/v1/realtime?model=qwen3-omni"


async def test_a_browser_names_its_key_and_dialect_as_subprotocols(bounded: str) -> None:
    with pytest.raises(websockets.InvalidStatus):
        async with websockets.connect(bounded, subprotocols=["realtime"]):
            pass
    protocols = ["realtime", "openai-insecure-api-key.sekret", "openai-beta.realtime-v1"]
    async with websockets.connect(bounded, subprotocols=protocols) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["session"]["modalities"] == ["text", "audio"]  # beta


async def test_a_response_past_the_in_flight_bound_fails_with_rate_limit(bounded: str) -> None:
    headers = {"Authorization": "Bearer sekret"}
    async with (
        websockets.connect(bounded, additional_headers=headers) as first,
        websockets.connect(bounded, additional_headers=headers) as second,
    ):
        for ws in (first, second):
            await ws.send(json.dumps({"type": "session.update", "session": MANUAL}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": TEXT_TURN}))
        await first.send(
            json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}})
        )
        await receive_until(first, "response.output_audio.delta")
        await second.send(json.dumps({"type": "response.create"}))
        kinds, done = await receive_until(second, "response.done")
        await first.send(json.dumps({"type": "response.cancel"}))
        await receive_until(first, "response.done")
    assert "error" not in kinds
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "rate_limit_exceeded"


async def receive_until(ws: Any, kind: str) -> tuple[list[str], dict[str, Any]]:
    """The event types up to the first ``kind``, and that event."""
    kinds = []
    with anyio.fail_after(60):
        while True:
            event = json.loads(await ws.recv())
            kinds.append(event["type"])
            if event["type"] == kind:
                return kinds, event


async def test_twenty_turns_reuse_the_conversation_and_leave_nothing_behind(live: Live) -> None:
    reused = live.thinker().reused_tokens
    async with connect(live) as conn:
        await conn.session.update(session={"type": "realtime"})  # server VAD on
        await until(conn, "session.updated")
        await send_audio(conn, np.zeros(CLIENT_RATE // 5, np.float32))  # the VAD stream opens
        for turn in range(20):
            await conn.conversation.item.create(item=TEXT_TURN)
            modalities = ["audio"] if turn % 5 == 0 else ["text"]
            await conn.response.create(
                response={"max_output_tokens": 3, "output_modalities": modalities}
            )
            assert (await until(conn, "response.done")).response.status == "completed"
            # Each turn after the first starts from the KV the turn before kept: at least
            # the turn before's prompt (the conversation grows by a turn each time).
            assert turn == 0 or live.thinker().reused_tokens - reused > 20 * turn
        assert await live.settled_request_blocks() == 0 < live.kv_blocks()  # conversation kept
    # The socket is closed: every request, walk, KV block (the kept conversation's too: the
    # session frees it as it ends) and VAD stream of it is gone.
    await live.all_released()


def warmed(live: Live, before: set[str]) -> int | None:
    """The tokens the thinker keeps of the one spoken turn warmed since ``before`` (the
    handles then), or None when none is kept."""
    names = [n for n in live.thinker().handles if n.startswith("warm:") and n not in before]
    return live.thinker().handles[names[0]][1] if names else None


async def test_a_turn_is_prefilled_while_spoken_and_a_clear_or_close_frees_it(live: Live) -> None:
    await no_other_conversations(live)
    thinker = live.thinker()
    before = set(thinker.handles)
    # Ten seconds of speech: the encoder's first 8 s window closes while it is spoken.
    long = np.concatenate([sentence(n) for n in ("story", "weather", "stop", "story", "weather")])
    window = 104  # the rows of one 8 s window
    async with connect(live) as conn:
        await conn.session.update(session=MANUAL)
        await until(conn, "session.updated")
        await send_audio(conn, long)
        # Before the commit, the response's prompt up to the window's last row is prefilled.
        assert await settled(lambda: (warmed(live, before) or 0) > window)
        kept = warmed(live, before)
        assert kept is not None
        await conn.input_audio_buffer.commit()
        await until(conn, "input_audio_buffer.committed")
        reused = thinker.reused_tokens
        await text_reply(conn)
        # The response took the warmed prefix instead of computing it: the whole window.
        assert window < thinker.reused_tokens - reused <= kept
        # Answered, and no turn is being heard: what was warmed goes (the conversation's kept
        # KV holds the turn now).
        assert await settled(lambda: warmed(live, before) is None)
        # A turn that is cleared while spoken leaves nothing warmed: no handle, no blocks.
        await send_audio(conn, sentence("stop"))
        assert await settled(lambda: warmed(live, before) is not None)
        await conn.input_audio_buffer.clear()
        await until(conn, "input_audio_buffer.cleared")
        assert await settled(lambda: warmed(live, before) is None)
        assert await live.settled_request_blocks() == 0
        # A closed session leaves nothing either, what was warmed included.
        await send_audio(conn, sentence("stop"))
        assert await settled(lambda: warmed(live, before) is not None)
    await live.all_released()
    assert not [n for n in thinker.handles if n not in before]
