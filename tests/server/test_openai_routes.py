"""The OpenAI-compatible routes through the real ``openai`` client and a real uvicorn server."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.server.conftest import Live
from tests.server.reference import runtime_outputs

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Say hello"}]


def test_models_lists_the_served_model_and_its_inputs(live: Live) -> None:
    models = live.client.models.list().data
    assert [m.id for m in models] == ["causal-lm"]
    assert {"messages", "prompt", "max_tokens", "stop"} <= set(models[0].model_extra["inputs"])


def test_chat_completion_is_the_runtime_text_with_exact_usage(
    live: Live, tiny_folder: Path
) -> None:
    text, end = runtime_outputs(tiny_folder, messages=MESSAGES, max_tokens=6, ignore_eos=True)
    reply = live.client.chat.completions.create(
        model="causal-lm", messages=MESSAGES, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion" and reply.model == "causal-lm"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (end.prompt_tokens, 6)
    assert reply.usage.total_tokens == end.prompt_tokens + 6


def test_streamed_chat_completion_joins_to_the_same_text(live: Live, tiny_folder: Path) -> None:
    text, end = runtime_outputs(tiny_folder, messages=MESSAGES, max_tokens=6, ignore_eos=True)
    stream = live.client.chat.completions.create(
        model="causal-lm",
        messages=MESSAGES,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == end.prompt_tokens
    assert live.served().admission.in_flight == 0


def test_completion_continues_the_prompt_as_written(live: Live, tiny_folder: Path) -> None:
    text, end = runtime_outputs(tiny_folder, prompt="def main():", max_tokens=5)
    reply = live.client.completions.create(model="causal-lm", prompt="def main():", max_tokens=5)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == end.finish_reason
    assert reply.usage is not None and reply.usage.completion_tokens == end.completion_tokens
    streamed = live.client.completions.create(
        model="causal-lm", prompt="def main():", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_a_stop_string_cuts_the_reply_and_finishes_with_stop(live: Live, tiny_folder: Path) -> None:
    text, _ = runtime_outputs(tiny_folder, messages=MESSAGES, max_tokens=8, ignore_eos=True)
    stop = text[3:5]
    reply = live.client.chat.completions.create(
        model="causal-lm",
        messages=MESSAGES,
        max_tokens=8,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "temperature": 3.5}, "temperature"),
        ({"messages": MESSAGES, "top_p": "high"}, "top_p"),
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "seed": -1}, "seed"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_a_bad_field_is_a_400_naming_it(live: Live, body: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        live.client.post("/chat/completions", body={"model": "causal-lm", **body}, cast_to=object)
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert param.split("[")[0] in caught.value.message


def test_the_typed_client_gets_the_same_error(live: Live) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        live.client.chat.completions.create(model="causal-lm", messages=MESSAGES, max_tokens=-3)
    assert caught.value.param == "max_tokens"


def test_an_unknown_model_is_a_404_naming_the_served_ones(live: Live) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        live.client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.param == "model"
    assert "'gpt-4o'" in caught.value.message and "['causal-lm']" in caught.value.message
