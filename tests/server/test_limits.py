"""Limits checked before admission: a prompt past the model's context, ``max_tokens`` past it,
and speech text past its character limit are refused at once with a 400 naming the field, on
every route, before the request starts any work."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from websockets.sync.client import connect

from mstar_async.graph import TokenCounter
from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from tests.server.conftest import Live, openai_client
from tests.server.live import http, live_server

pytestmark = pytest.mark.timeout(120)

#: The tiny Llama's positions: its context limit.
CONTEXT = 256
#: Characters of speech text orpheus takes in this server.
CHARS = 40
LONG_PROMPT = "we are " * 200  # far past 256 tokens
SPEECH = {"seed": 1, "max_tokens": 14}


@pytest.fixture(scope="module")
def live(tiny_folder: Path) -> Iterator[Live]:
    models = [
        ModelSpec(build_model("causal-lm", path=tiny_folder, dtype="float32")),
        ModelSpec(build_model("orpheus"), max_text_chars=CHARS),
    ]
    app = create_app(models, max_concurrent=2)
    with live_server(app) as url, openai_client(url) as client:
        yield Live(url, app, client)


def refused(live: Live, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body``: it must be a 400 in OpenAI's shape that started no work (no forward ran,
    nothing was admitted). Returns the error object."""
    loops = [live.served(name).runtime.batching for name in ("causal-lm", "orpheus")]
    forwards = [loop.stats.forwards for loop in loops]
    reply = http("POST", live.url + route, body)
    assert reply.status == 400, reply.body
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert [loop.stats.forwards for loop in loops] == forwards
    assert all(live.served(n).admission.in_flight == 0 for n in ("causal-lm", "orpheus"))
    return error


def count(live: Live) -> TokenCounter:
    context = live.served().runtime.model.context
    assert context is not None
    return context.count


def test_models_list_their_context_length_and_text_limit(live: Live) -> None:
    models = {m["id"]: m for m in http("GET", live.url + "/v1/models").json()["data"]}
    assert models["causal-lm"]["context_length"] == CONTEXT
    assert models["causal-lm"]["max_text_chars"] is None  # it does not speak
    assert models["orpheus"]["max_text_chars"] == CHARS


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 16}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 16},
            "messages",
        ),
        ("/generate", {"inputs": {"prompt": LONG_PROMPT, "max_tokens": 16}}, "inputs.prompt"),
    ],
)
def test_a_prompt_past_the_context_is_a_400_naming_it(
    live: Live, route: str, body: dict[str, Any], param: str
) -> None:
    error = refused(live, route, {"model": "causal-lm", **body})
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    name = "inputs.max_tokens" if route == "/generate" else "max_tokens"
    assert (
        f"; model 'causal-lm' takes at most {CONTEXT} tokens including {name} (16): "
        in (error["message"])
    )
    assert error["message"].startswith(f"{param} is ")


def test_the_default_max_tokens_counts_too(live: Live) -> None:
    # About 200 prompt tokens fit alone, not with the program's default max_tokens (64).
    prompt = "we " * 100
    tokens = count(live)({"prompt": prompt})
    assert tokens + 64 > CONTEXT >= tokens
    error = refused(live, "/v1/completions", {"model": "causal-lm", "prompt": prompt})
    assert "including max_tokens (64)" in error["message"]


def test_max_tokens_past_the_context_is_a_400_naming_it(live: Live) -> None:
    error = refused(
        live, "/v1/completions", {"model": "causal-lm", "prompt": "hi", "max_tokens": 5000}
    )
    assert error["param"] == "max_tokens"
    assert error["message"] == (
        f"max_tokens is 5000; model 'causal-lm' takes at most {CONTEXT} tokens including the "
        "prompt: lower max_tokens"
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999}
    error = refused(live, "/v1/chat/completions", {"model": "causal-lm", **chat})
    assert error["param"] == "max_completion_tokens"


def test_a_request_that_fits_exactly_runs(live: Live) -> None:
    tokens = count(live)
    prompt = next(p for n in range(1, 400) if tokens({"prompt": (p := "we " * n)}) >= 200)
    budget = CONTEXT - tokens({"prompt": prompt})
    reply = live.client.completions.create(
        model="causal-lm", prompt=prompt, max_tokens=budget, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.total_tokens == CONTEXT
    with pytest.raises(openai.BadRequestError) as caught:
        live.client.completions.create(model="causal-lm", prompt=prompt, max_tokens=budget + 1)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"


def test_an_empty_prompt_is_a_400(live: Live) -> None:
    error = refused(live, "/v1/completions", {"model": "causal-lm", "prompt": ""})
    assert (error["param"], error["message"]) == (
        "prompt",
        "prompt is empty: send at least one token",
    )
    error = refused(live, "/generate", {"model": "causal-lm", "inputs": {}})
    assert error["param"] == "inputs.prompt"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/audio/speech", {"input": "x" * (CHARS + 1), **SPEECH}, "input"),
        ("/generate", {"inputs": {"text": "x" * (CHARS + 1), **SPEECH}}, "inputs.text"),
    ],
)
def test_speech_text_past_the_limit_is_a_400_naming_it(
    live: Live, route: str, body: dict[str, Any], param: str
) -> None:
    error = refused(live, route, {"model": "orpheus", **body})
    assert error["param"] == param
    assert error["message"].startswith(
        f"{param} is {CHARS + 1} characters; model 'orpheus' speaks at most {CHARS} characters"
    )


def test_speech_text_at_the_limit_is_spoken(live: Live) -> None:
    reply = http(
        "POST",
        live.url + "/v1/audio/speech",
        {"model": "orpheus", "input": "Hello. " * (CHARS // 7) + "x" * (CHARS % 7), **SPEECH},
    )
    assert reply.status == 200 and reply.body[:4] == b"RIFF"


def test_a_websocket_segment_past_the_limit_is_refused_and_the_session_goes_on(
    live: Live,
) -> None:
    url = live.url.replace("http", "ws") + "/v1/audio/speech/stream"
    with connect(f"{url}?model=orpheus&format=json&seed=1&max_tokens=14") as ws:
        json.loads(ws.recv())  # ready
        ws.send(json.dumps({"type": "text", "text": "Hi. "}))  # one segment, buffered none
        ws.send(json.dumps({"type": "text", "text": "y" * (CHARS + 1)}))  # too long to buffer
        ws.send(json.dumps({"type": "text", "text": "z" * (CHARS + 1) + ". "}))  # a long sentence
        ws.send(json.dumps({"type": "text", "text": "Bye"}))
        ws.send(json.dumps({"type": "end"}))
        events = [json.loads(m) for m in ws]
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == ["text", "text"]
    assert all(f"speaks at most {CHARS} characters" in e["message"] for e in errors)
    done = [e["segment"] for e in events if e["type"] == "segment_done"]
    assert done == [0, 1] and events[-1] == {"type": "done"}  # "Hi." and "Bye"


def test_a_websocket_max_tokens_past_the_context_names_it(live: Live) -> None:
    url = live.url.replace("http", "ws") + "/v1/audio/speech/stream"
    with connect(f"{url}?model=orpheus&format=json&max_tokens=999999") as ws:
        json.loads(ws.recv())  # ready
        ws.send(json.dumps({"type": "text", "text": "Hi. "}))
        error = json.loads(ws.recv())["error"]
        ws.send(json.dumps({"type": "end"}))
        assert json.loads(ws.recv()) == {"type": "done"}
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(live: Live) -> None:
    context = live.served().runtime.model.context
    assert context is not None and context.token_chars is not None
    chars = CONTEXT * context.token_chars + 1
    error = refused(
        live, "/v1/completions", {"model": "causal-lm", "prompt": "x" * chars, "max_tokens": 1}
    )
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith(f"prompt is {chars} characters, more than ")


def test_counting_a_long_prompt_leaves_the_server_answering() -> None:
    # SmolLM2: 8192 tokens of up to 81 characters each, so a prompt of a few hundred thousand
    # characters has to be tokenized to be refused; that takes a good fraction of a second.
    model = build_model("causal-lm")
    context = model.context
    assert context is not None and context.token_chars is not None
    prompt = "".join(f"the number {i} is written here. " for i in range(15_000))
    assert 16_384 < len(prompt) < context.tokens * context.token_chars
    started = time.perf_counter()
    assert context.count({"prompt": prompt}) > context.tokens
    counting = time.perf_counter() - started
    with live_server(create_app([ModelSpec(model)])) as url:
        waits: list[float] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                asked = time.perf_counter()
                assert http("GET", url + "/health").status == 200
                waits.append(time.perf_counter() - asked)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            reply = http("POST", url + "/v1/completions", {"model": "causal-lm", "prompt": prompt})
        finally:
            done.set()
            poller.join()
    assert reply.status == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    # Counted on a worker thread: the loop kept answering, each answer in well under the time
    # the count takes (measured here, under the same load).
    assert len(waits) >= 3
    assert max(waits) < counting / 2, (max(waits), counting)
