"""Tool calls in the Qwen format: parsed as the text streams however it is cut, and a session
that turns them into ``function_call`` items and reads the client's outputs back to the model
(the model's text scripted here; the session, conversation and events are the real ones)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.outputs import TextDelta
from mstar_async.realtime.config import SessionConfig
from mstar_async.realtime.session import RealtimeSession
from mstar_async.realtime.tool_calls import ParsedCall, ToolCallParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"Let me look.\n{CALL}\nDone <tool not a call"


def _parse(pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    parser = ToolCallParser()
    shown, calls = [], []
    for piece in pieces:
        text, found = parser.push(piece)
        shown.append(text)
        calls.extend(found)
    shown.append(parser.flush())
    return "".join(shown), calls


@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_the_same_calls_and_text_however_the_stream_is_cut(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TEXT)]
    pieces = [TEXT[a:b] for a, b in itertools.pairwise(bounds)]
    shown, calls = _parse(pieces)
    assert calls == [ParsedCall("get_weather", json.dumps({"city": "Paris"}))]
    assert shown == "Let me look.\n\nDone <tool not a call"


def test_a_call_that_does_not_parse_stays_text() -> None:
    bad = "<tool_call>{not json}</tool_call> and <tool_call>"
    shown, calls = _parse([bad])
    assert calls == [] and shown == bad


def _scripted(replies: list[str], seen: list[list[dict[str, str]]]) -> Any:
    class Reply:
        def __init__(self, text: str) -> None:
            self.text = text

        async def outputs(self) -> AsyncIterator[Any]:
            for start in range(0, len(self.text), 7):
                yield TextDelta(self.text[start : start + 7])

        def usage(self) -> dict[str, int]:
            return {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}

    @asynccontextmanager
    async def respond(
        messages: list[dict[str, str]], config: SessionConfig
    ) -> AsyncIterator[Reply]:
        seen.append(messages)
        yield Reply(replies.pop(0))

    return respond


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_call_becomes_a_function_call_item_and_its_output_reaches_the_model() -> None:
    sent: list[dict[str, Any]] = []
    seen: list[list[dict[str, str]]] = []
    send_client, receive_client = anyio.create_memory_object_stream[Any](16)

    async def send(event: dict[str, Any] | None) -> None:
        if event is not None:
            sent.append(event)

    session = RealtimeSession(
        send,
        _scripted([f"Checking. {CALL}", "It is sunny."], seen),
        model="scripted",
        model_rate=24_000,
        vad=None,
        beta=False,
        config=SessionConfig(modalities=("text",)),
    )
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}

    async def done(count: int) -> None:
        with anyio.fail_after(10):
            while sum(e["type"] == "response.done" for e in sent) < count:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    async def client() -> None:
        async with send_client:
            await send_client.send({"type": "session.update", "session": {"tools": [tool]}})
            turn = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather?"}],
            }
            await send_client.send({"type": "conversation.item.create", "item": turn})
            await send_client.send({"type": "response.create"})
            await done(1)
            call = next(e for e in sent if e["type"] == "response.function_call_arguments.done")
            output = {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": '{"sky": "sunny"}',
            }
            await send_client.send({"type": "conversation.item.create", "item": output})
            await send_client.send({"type": "response.create"})
            await done(2)

    async def events() -> AsyncIterator[Any]:
        async with receive_client:
            async for event in receive_client:
                yield event

    async with anyio.create_task_group() as tg:
        tg.start_soon(client)
        await session.run(events())
    first = next(e for e in sent if e["type"] == "response.done")["response"]
    kinds = [item["type"] for item in first["output"]]
    assert kinds == ["message", "function_call"]
    assert first["output"][0]["content"][0]["text"] == "Checking. "
    assert first["output"][1]["name"] == "get_weather"
    assert json.loads(first["output"][1]["arguments"]) == {"city": "Paris"}
    assert "<tools>" in seen[0][0]["content"] and "get_weather" in seen[0][0]["content"]
    assert seen[1][-2]["content"].startswith("<tool_call>")
    assert seen[1][-1] == {"role": "tool", "content": '{"sky": "sunny"}'}
    assert first["usage"] == {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}


def test_a_full_conversation_drops_its_oldest_items_for_a_reply() -> None:
    from mstar_async.realtime.conversation import MAX_ITEMS, Conversation, Message
    from mstar_async.realtime.events import RealtimeError

    conversation = Conversation()
    first = Message("user", "hello")
    conversation.add(first)
    for _ in range(MAX_ITEMS - 1):
        conversation.add(Message("user", "more"))
    with pytest.raises(RealtimeError, match="holds 512 items"):
        conversation.add(Message("user", "one too many"))
    reply = Message("assistant", "still heard")
    assert conversation.append_reply(reply) == [first.id]
    assert len(conversation.items) == MAX_ITEMS and conversation.items[-1] is reply
