"""``/generate`` streams every output type of any model; ``/metrics`` counts what happened."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.runtime import open_runtime
from mstar_async.server import ModelSpec, create_app
from tests.server.conftest import openai_client
from tests.server.live import http, live_server

pytestmark = pytest.mark.timeout(120)

DEMO_INPUTS = {"text": "hi", "max_codes": 12, "steps": 2}


@pytest.fixture(scope="module")
def url(tiny_folder: Path) -> Iterator[str]:
    lm = build_model("causal-lm", path=tiny_folder, dtype="float32")
    app = create_app([ModelSpec(lm), ModelSpec(build_model("demo"))], max_concurrent=4)
    with live_server(app) as base:
        yield base


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    reply = http("POST", f"{url}/generate", body)
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in reply.body.decode().splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: ") :]) for line in lines]


def demo_outputs() -> list[Any]:
    async def run() -> list[Any]:
        async with open_runtime(build_model("demo")) as runtime:
            async with runtime.generate(**DEMO_INPUTS) as outputs:
                return [item async for item in outputs]

    return anyio.run(run)


def png_pixels(data: bytes) -> torch.Tensor:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and color == 2  # 8-bit RGB
    idat_length = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT"
    raw = zlib.decompress(data[41 : 41 + idat_length])
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(height, 1 + width * 3)
    assert rows[:, 0].eq(0).all()
    return rows[:, 1:].reshape(height, width, 3).permute(2, 0, 1)


def test_generate_streams_audio_then_an_image_equal_to_the_runtimes(url: str) -> None:
    got = events(url, {"model": "demo", "inputs": DEMO_INPUTS})
    expected = demo_outputs()
    assert [e["type"] for e in got] == [
        *("audio" if isinstance(o, AudioChunk) else "image" for o in expected),
        "done",
    ]
    for event, output in zip(got, expected, strict=False):
        if isinstance(output, AudioChunk):
            assert (event["sample_rate"], event["format"]) == (16_000, "s16le")
            pcm = torch.frombuffer(bytearray(base64.b64decode(event["data"])), dtype=torch.int16)
            assert event["samples"] == pcm.numel() == output.pcm.numel()
            want = (output.pcm.clamp(-1, 1) * 32767).round().to(torch.int16)
            assert torch.equal(pcm, want)
        else:
            assert isinstance(output, ImageOutput)
            assert event["shape"] == list(output.image.shape)
            want = (output.image.clamp(0, 1) * 255).round().to(torch.uint8)
            assert torch.equal(png_pixels(base64.b64decode(event["data"])), want)


def test_generate_streams_text_and_its_end_as_ndjson(url: str) -> None:
    body = {
        "model": "causal-lm",
        "inputs": {"prompt": "we", "max_tokens": 4, "ignore_eos": True},
        "format": "ndjson",
    }
    reply = http("POST", f"{url}/generate", body)
    assert reply.headers["content-type"] == "application/x-ndjson"
    got = [json.loads(line) for line in reply.body.decode().splitlines()]
    assert {e["type"] for e in got[:-2]} == {"text"}
    assert got[-2]["type"] == "text_end"
    assert (got[-2]["completion_tokens"], got[-2]["finish_reason"]) == (4, "length")
    assert got[-1] == {"type": "done"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "demo", "inputs": {"colour": "red"}}, 400, "inputs.colour"),
        ({"model": "demo", "inputs": {"max_codes": "many"}}, 400, "inputs.max_codes"),
        ({"model": "demo", "inputs": []}, 400, "inputs"),
        ({"inputs": {}}, 400, "model"),
        ({"model": "speech", "inputs": {}}, 404, "model"),
    ],
)
def test_generate_errors_name_the_problem(
    url: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    reply = http("POST", f"{url}/generate", body)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    if status == 404:
        assert "['causal-lm', 'demo']" in error["message"]


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http("GET", f"{url}/metrics").body.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_tokens_batches_and_kv_blocks(url: str) -> None:
    before = _samples(url)
    with openai_client(url) as client:
        reply = client.chat.completions.create(
            model="causal-lm",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": ""}])
    after = _samples(url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    chat = {"model": "causal-lm", "route": "/v1/chat/completions"}
    assert grew("mstar_requests_total", **chat, status="200") == 1
    assert grew("mstar_requests_total", model="", route=chat["route"], status="404") == 1
    assert grew("mstar_output_tokens_total", model="causal-lm") == 3
    assert reply.usage is not None
    assert grew("mstar_prompt_tokens_total", model="causal-lm") == reply.usage.prompt_tokens
    assert grew("mstar_time_to_first_byte_seconds_count", **chat) == 1
    assert grew("mstar_request_duration_seconds_count", **chat) == 1
    assert after[("mstar_requests_in_flight", (("model", "causal-lm"),))] == 0
    forwards = grew("mstar_forwards_total", model="causal-lm", rank="0")
    assert forwards >= 3  # a prefill and two decodes at least
    assert grew("mstar_batch_size_count", model="causal-lm", rank="0") == forwards
    kv = (("engine", "lm"), ("model", "causal-lm"), ("rank", "0"))
    assert after[("mstar_kv_blocks_in_use", kv)] == 0
    assert after[("mstar_kv_blocks", kv)] > 0
    rank = (("model", "causal-lm"), ("rank", "0"))
    assert after[("mstar_rank_up", rank)] == 1 and after[("mstar_steps_waiting", rank)] == 0
