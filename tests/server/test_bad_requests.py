"""Every client error is a 4xx in OpenAI's shape: wrong types, missing fields, out-of-range and
empty values on every route, for every kind of model; none is a 500 or an empty 200."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from tests.server.live import http, live_server

pytestmark = pytest.mark.timeout(120)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tiny_folder: Path) -> Iterator[str]:
    torch.set_num_threads(1)  # the small matrices run faster on one thread of a busy machine
    lm = build_model("causal-lm", path=tiny_folder, dtype="float32")
    others = [build_model(name) for name in ("orpheus", "qwen3-omni", "bagel", "pi05", "vjepa2")]
    app = create_app([ModelSpec(model) for model in (lm, *others)], max_concurrent=4)
    with live_server(app) as base:
        yield base


def _generate(model: str, **inputs: Any) -> tuple[str, dict[str, Any]]:
    return "/generate", {"model": model, "inputs": inputs}


BAD = [
    # The text routes.
    ("/v1/completions", {"model": "causal-lm", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "causal-lm", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "causal-lm", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "causal-lm"}, "prompt"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "causal-lm", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", [], None),
    ("/v1/completions", "prompt", None),
    ("/v1/chat/completions", {"model": "causal-lm", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "causal-lm", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "causal-lm", "messages": [5]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "causal-lm", "messages": [{}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "causal-lm", "messages": HI, "n": 0}, "n"),
    ("/v1/chat/completions", {"model": "qwen3-omni", "messages": HI, "audio": 5}, "audio"),
    ("/v1/chat/completions", {"model": "orpheus", "messages": HI}, "model"),
    ("/v1/chat/completions", {"model": 7, "messages": HI}, "model"),
    # Speech.
    ("/v1/audio/speech", {"model": "orpheus", "input": ""}, "input"),
    ("/v1/audio/speech", {"model": "orpheus", "input": "   ", "max_tokens": 7}, "input"),
    ("/v1/audio/speech", {"model": "orpheus", "input": 5}, "input"),
    ("/v1/audio/speech", {"model": "orpheus"}, "input"),
    ("/v1/audio/speech", {"model": "orpheus", "input": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/audio/speech", {"model": "orpheus", "input": "hi", "seed": 2**70}, None),
    ("/v1/audio/speech", {"model": "orpheus", "input": "hi", "voice": {}}, "voice.id"),
    ("/v1/audio/speech", {"model": "orpheus", "input": "x" * 5000}, "input"),
    ("/v1/audio/speech", {"model": "causal-lm", "input": "hi"}, "model"),
    (
        "/v1/audio/speech",
        {"model": "qwen3-omni", "input": "hi", "repetition_penalty": -1},
        "repetition_penalty",
    ),
    (
        "/v1/audio/speech",
        {"model": "orpheus", "input": "hi", "repetition_penalty": 1.1},
        "repetition_penalty",
    ),
    (*_generate("qwen3-omni", text="hi", repetition_penalty=0), None),
    # Images.
    ("/v1/images/generations", {"model": "bagel", "prompt": ""}, "prompt"),
    ("/v1/images/generations", {"model": "bagel", "prompt": 5}, "prompt"),
    ("/v1/images/generations", {"model": "bagel", "prompt": "x", "steps": 10**8}, None),
    ("/v1/images/generations", {"model": "bagel", "prompt": "x", "steps": 0}, "steps"),
    # The native route: each model's program inputs, of the wrong type or out of range.
    (*_generate("causal-lm", prompt=""), "inputs.prompt"),
    (*_generate("causal-lm", prompt=None), "inputs.prompt"),
    (*_generate("causal-lm", prompt="hi", max_tokens="x"), "inputs.max_tokens"),
    (*_generate("causal-lm", prompt="hi", max_tokens=2.5), "inputs.max_tokens"),
    (*_generate("causal-lm", prompt="hi", max_tokens=True), "inputs.max_tokens"),
    (*_generate("causal-lm", prompt="hi", max_tokens=0), None),
    (*_generate("causal-lm", prompt="hi", stop="x"), "inputs.stop"),
    (*_generate("causal-lm", prompt="hi", chat="yes"), "inputs.chat"),
    (*_generate("causal-lm", messages=[{"x": 1}]), "inputs.messages[0][...]"),
    (*_generate("causal-lm", messages=[{"x": "1"}]), "inputs.messages"),
    (*_generate("orpheus", text=5), "inputs.text"),
    (*_generate("orpheus", text=["hi"]), "inputs.text"),
    (*_generate("orpheus", text="hi", voice=5), "inputs.voice"),
    (*_generate("orpheus", text="hi", temperature=-1), None),
    (*_generate("qwen3-omni", text="hi", speaker=5), "inputs.speaker"),
    (*_generate("qwen3-omni", messages=[{"role": "x"}]), "inputs.messages"),
    (*_generate("qwen3-omni", text="hi", max_tokens=-3), None),
    (*_generate("bagel", prompt=5), "inputs.prompt"),
    (*_generate("bagel", prompt="x", steps="a"), "inputs.steps"),
    (*_generate("bagel", prompt="x", steps=10**8), None),
    (*_generate("bagel", prompt="x", timestep_shift=0), None),
    (*_generate("pi05", steps=0), None),
    (*_generate("pi05", steps="x"), "inputs.steps"),
    (*_generate("pi05", instruction=5), "inputs.instruction"),
    (*_generate("pi05", state=[1, 2]), None),
    (*_generate("pi05", state="x"), "inputs.state"),
    (*_generate("vjepa2", horizon=0), None),
    (*_generate("vjepa2", horizon=1, video=[[1]]), None),
    (*_generate("vjepa2", horizon=1, seed="x"), "inputs.seed"),
    (*_generate("vjepa2", horizon=1, actions="x"), "inputs.actions"),
    ("/generate", {"model": "vjepa2", "inputs": {"colour": 1}}, "inputs.colour"),
    ("/generate", {"model": "vjepa2", "inputs": [1]}, "inputs"),
    ("/generate", {"model": "vjepa2", "format": "xml"}, "format"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD)
def test_a_bad_request_is_a_4xx_in_openais_shape(
    url: str, route: str, body: Any, param: str | None
) -> None:
    reply = http("POST", url + route, body)
    assert 400 <= reply.status < 500, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_a_wrong_input_type_names_the_field_and_the_type(url: str) -> None:
    error = http("POST", url + "/generate", {"model": "orpheus", "inputs": {"text": 5}}).json()
    assert error["error"]["message"] == "inputs.text: Expected `str`, got `int`"


def test_a_tensor_input_comes_as_nested_lists(url: str) -> None:
    body = {"model": "pi05", "inputs": {"state": [0.1, -0.2, 0.3, 0.0], "steps": 1}}
    reply = http("POST", url + "/generate", body)
    assert reply.status == 200
    events = [json.loads(e[len("data: ") :]) for e in reply.body.decode().split("\n\n") if e]
    assert [e["type"] for e in events] == ["action", "done"]


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_speech_that_makes_no_audio_is_a_valid_empty_stream(url: str, fmt: str) -> None:
    body = {"model": "orpheus", "input": "Hi.", "max_tokens": 1, "response_format": fmt}
    reply = http("POST", url + "/v1/audio/speech", body)
    assert reply.status == 200
    if fmt == "wav":
        assert len(reply.body) == 44
        with wave.open(io.BytesIO(reply.body)) as audio:
            assert (audio.getnframes(), audio.getframerate()) == (0, 24_000)
    elif fmt == "flac":
        assert reply.body[:4] == b"fLaC" and len(reply.body) == 42
    elif fmt == "opus":
        assert reply.body[:4] == b"OggS"
    else:
        assert reply.body == b""  # headerless: no samples, no bytes


def test_a_spoken_chat_reply_without_audio_still_carries_a_wav(url: str) -> None:
    body = {
        "model": "qwen3-omni",
        "messages": HI,
        "max_tokens": 1,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "wav"},
    }
    reply = http("POST", url + "/v1/chat/completions", body)
    assert reply.status == 200
    data = base64.b64decode(reply.json()["choices"][0]["message"]["audio"]["data"])
    with wave.open(io.BytesIO(data)) as audio:
        assert audio.getframerate() == 24_000
