"""Speech, spoken chat, images and the websocket speech stream, through real clients.

One live server serves tiny orpheus, qwen3-omni and bagel; the ``openai`` client and the
``websockets`` client talk to it as users would.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from tests.server.conftest import Live, openai_client
from tests.server.live import http, live_server

pytestmark = pytest.mark.timeout(60)

RATE = 24_000
SNAC_FRAME = 2048  # samples per orpheus frame
SPEECH = {"seed": 1, "max_tokens": 84}  # 12 frames: a bounded utterance


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    torch.set_num_threads(1)  # the small matrices run faster on one thread of a busy machine
    models = [ModelSpec(build_model(name)) for name in ("orpheus", "qwen3-omni", "bagel")]
    app = create_app(models, max_concurrent=4)
    with live_server(app) as url, openai_client(url) as client:
        yield Live(url, app, client)


def _speak(live: Live, **body: Any) -> bytes:
    fields = {"model": "orpheus", "voice": "tara", "input": "Hello there.", **body}
    fields.setdefault("extra_body", SPEECH)
    with live.client.audio.speech.with_streaming_response.create(**fields) as response:
        assert response.headers["x-sample-rate"] == str(RATE)
        return b"".join(response.iter_bytes(1024))


def test_streamed_speech_is_a_valid_24khz_wav(live: Live, tmp_path: Path) -> None:
    path = tmp_path / "hello.wav"
    with live.client.audio.speech.with_streaming_response.create(
        model="orpheus",
        voice="tara",
        input="Hello there.",
        response_format="wav",
        extra_body=SPEECH,
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert "content-length" not in response.headers  # chunked: written as synthesised
        response.stream_to_file(path)
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    # Whole frames only, at most the 12 frames max_tokens allows; not silence.
    assert samples.size % SNAC_FRAME == 0 and 0 < samples.size <= 12 * SNAC_FRAME
    assert np.abs(samples).max() > 0
    # The same request as raw PCM gives the same samples (seeded sampling).
    pcm = np.frombuffer(_speak(live, response_format="pcm"), "<i2")
    np.testing.assert_array_equal(pcm, samples)


def test_flac_and_mp3_decode_to_the_same_speech(live: Live) -> None:
    pcm = np.frombuffer(_speak(live, response_format="pcm"), "<i2") / 32767
    flac = _speak(live, response_format="flac")
    assert flac[:4] == b"fLaC"
    # A streamed FLAC says "length unknown" (0), which flac and ffmpeg read to the end;
    # libsndfile's reader wants the length, so the test writes it in first.
    (word,) = struct.unpack(">Q", flac[18:26])
    assert word & ((1 << 36) - 1) == 0
    known = flac[:18] + struct.pack(">Q", word | pcm.size) + flac[26:]
    decoded, rate = soundfile.read(io.BytesIO(known))
    assert rate == RATE
    np.testing.assert_allclose(decoded, pcm, atol=2 / 32767)
    mp3, rate = soundfile.read(io.BytesIO(_speak(live, response_format="mp3")))
    assert rate == RATE and pcm.size <= mp3.size <= pcm.size + 4096


def test_sse_speech_streams_deltas_then_done(live: Live) -> None:
    reply = http(
        "POST",
        f"{live.url}/v1/audio/speech",
        {
            "model": "orpheus",
            "voice": "leo",
            "input": "Hi.",
            "stream_format": "sse",
            "response_format": "pcm",
            **SPEECH,
        },
    )
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e[len("data: ") :]) for e in reply.body.decode().split("\n\n") if e]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * events[-1]["samples"] and events[-1]["samples"] % SNAC_FRAME == 0
    assert len(events) > 2  # pieces as synthesised, not one blob


def test_qwen3_omni_speaks_its_reply_on_the_speech_route(live: Live) -> None:
    pcm = _speak(
        live,
        model="qwen3-omni",
        voice="Chelsie",
        response_format="pcm",
        extra_body={"max_tokens": 2, "seed": 0},
    )
    assert len(pcm) > 0 and len(pcm) % 2 == 0


def test_repetition_penalty_reaches_the_talker_of_qwen3_omni(live: Live) -> None:
    def speak(**extra: Any) -> bytes:
        body = {"max_tokens": 2, "seed": 0, **extra}
        return _speak(
            live, model="qwen3-omni", voice="ethan", response_format="pcm", extra_body=body
        )

    default = speak()
    # Upstream's default penalty is the program's: the same speech as when it is given.
    assert speak(repetition_penalty=1.05) == default
    # Seeded: only the penalty differs, and a strong one changes what is said.
    assert speak(repetition_penalty=3.0) != default


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": "aac"}, "response_format", "supported: wav, flac, mp3, opus, pcm"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0.0"),
        ({"repetition_penalty": "x"}, "repetition_penalty", "got `str`"),
        ({"repetition_penalty": 1.1}, "repetition_penalty", "takes no 'repetition_penalty'"),
        ({"voice": "alloy"}, "voice", "its voices: tara"),
        ({"speed": 1.5}, "speed", "speed 1.0"),
        ({"speed": 9.0}, "speed", "<= 4.0"),
        ({"input": ""}, "input", "length >= 1"),
        ({"stream_format": "chunks"}, "stream_format", "Invalid enum value 'chunks'"),
        ({"model": "bagel"}, "model", "does not make speech"),
    ],
)
def test_a_bad_speech_field_is_a_400_naming_it(
    live: Live, body: dict[str, Any], param: str, words: str
) -> None:
    fields = {"model": "orpheus", "voice": "tara", "input": "Hello.", **body}
    with pytest.raises(openai.BadRequestError) as caught:
        live.client.post("/audio/speech", body=fields, cast_to=object)
    assert caught.value.param == param and words in caught.value.message


OMNI = {"model": "qwen3-omni", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
OMNI_EXTRA = {"max_frames": 30, "ignore_eos": True}


def test_a_spoken_chat_reply_has_audio_and_its_transcript(live: Live) -> None:
    text_only = live.client.chat.completions.create(**OMNI, extra_body={"ignore_eos": True})
    reply = live.client.chat.completions.create(
        **OMNI,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        extra_body=OMNI_EXTRA,
    )
    message = reply.choices[0].message
    assert message.content is None and message.audio is not None
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > time.time()
    assert message.audio.transcript == text_only.choices[0].message.content
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getframerate() == RATE and w.getnframes() > 0


def test_a_streamed_spoken_chat_interleaves_transcript_and_pcm16(live: Live) -> None:
    whole = live.client.chat.completions.create(
        **OMNI,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        extra_body=OMNI_EXTRA,
    )
    stream = live.client.chat.completions.create(
        **OMNI,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
        extra_body=OMNI_EXTRA,
    )
    chunks = list(stream)
    audio = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    kinds = ["data" if a.data else "transcript" for a in audio if a.data or a.transcript]
    assert kinds.index("transcript") < kinds.index("data")  # text first, then interleaved
    assert audio[0].id and {a.id for a in audio} == {audio[0].id}
    assert audio[-1].expires_at and not audio[-1].data
    transcript = "".join(a.transcript or "" for a in audio)
    pcm = b"".join(base64.b64decode(a.data) for a in audio if a.data)
    assert whole.choices[0].message.audio is not None
    assert transcript == whole.choices[0].message.audio.transcript
    assert pcm == base64.b64decode(whole.choices[0].message.audio.data)
    # qwen3-omni reports no token counts (no TextEnd): the usage chunk comes, with zeros.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"modalities": ["audio"], "audio": {"voice": "ethan", "format": "aac"}}, "audio.format"),
        ({"modalities": ["audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio.voice"),
        (
            {"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}, "stream": True},
            "audio.format",
        ),
    ],
)
def test_a_bad_audio_chat_field_is_a_400_naming_it(
    live: Live, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        live.client.post("/chat/completions", body={**OMNI, **extra}, cast_to=object)
    assert caught.value.param == param


def test_images_generate_returns_a_png_of_the_models_size(live: Live) -> None:
    result = live.client.images.generate(
        model="bagel", prompt="a red circle", size="64x64", extra_body={"steps": 2}
    )
    png = base64.b64decode(result.data[0].b64_json or "")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        assert image.size == (64, 64) and image.mode == "RGB"
    for field, value in (("size", "1024x1024"), ("response_format", "url"), ("n", 2)):
        with pytest.raises(openai.BadRequestError) as caught:
            live.client.images.generate(model="bagel", prompt="x", **{field: value})
        assert caught.value.param == field


def _ws(live: Live, query: str) -> Any:
    return connect(f"{live.url.replace('http', 'ws')}/v1/audio/speech/stream?{query}")


def test_websocket_speaks_each_flushed_segment_in_order(live: Live) -> None:
    with _ws(live, "model=orpheus&voice=tara&format=json&seed=1&max_tokens=42") as ws:
        assert json.loads(ws.recv()) == {
            "type": "ready",
            "sample_rate": RATE,
            "encoding": "pcm_s16le",
        }
        ws.send(json.dumps({"type": "text", "text": "Hello there. How"}))  # one sentence ends
        ws.send(json.dumps({"type": "text", "text": " are you"}))
        ws.send(json.dumps({"type": "flush"}))
        ws.send(json.dumps({"type": "text", "text": "Bye"}))
        ws.send(json.dumps({"type": "end"}))
        events = [json.loads(m) for m in ws]
    done = [e["segment"] for e in events if e["type"] == "segment_done"]
    assert done == [0, 1, 2] and events[-1] == {"type": "done"}
    audio_segments = [e["segment"] for e in events if e["type"] == "audio"]
    assert audio_segments == sorted(audio_segments) and set(audio_segments) <= {0, 1, 2}
    for k in set(audio_segments):  # each segment's audio comes before its segment_done
        last_audio = max(i for i, e in enumerate(events) if e.get("segment") == k and "data" in e)
        assert last_audio < events.index({"type": "segment_done", "segment": k})


def test_websocket_answers_bad_messages_and_a_bad_query_with_errors(live: Live) -> None:
    with _ws(live, "model=orpheus&format=json&max_tokens=14") as ws:
        json.loads(ws.recv())  # ready
        ws.send(b"\x00\x01")
        assert "JSON is malformed" in json.loads(ws.recv())["error"]["message"]
        ws.send(json.dumps({"type": "shout"}))
        error = json.loads(ws.recv())["error"]
        assert error["param"] == "type" and "'shout'" in error["message"]
        ws.send(json.dumps({"type": "end"}))  # nothing buffered: done at once
        assert json.loads(ws.recv()) == {"type": "done"}
    with _ws(live, "model=bagel") as ws:
        assert json.loads(ws.recv())["error"]["param"] == "model"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    info = {m.id: m.model_extra["info"] for m in live.client.models.list().data}
    assert info["orpheus"]["sample_rate"] == RATE and "tara" in info["orpheus"]["voices"]
    assert info["bagel"] == {"image_size": 64, "image_inputs": ["image"]}


def test_websocket_cancel_and_disconnect_free_the_kv_blocks(live: Live) -> None:
    served = live.served("orpheus")
    engine = served.runtime.batching.engines["lm"]
    # This seed speaks "A long story" for ~200 frames: it is still speaking when the test leaves.
    long_speech = "model=orpheus&voice=tara&max_tokens=4000&temperature=1.0&top_p=1.0&seed=4"
    for leave in ("cancel", "disconnect"):
        with _ws(live, long_speech) as ws:
            json.loads(ws.recv())  # ready
            ws.send(json.dumps({"type": "text", "text": "A long story"}))
            ws.send(json.dumps({"type": "flush"}))
            first = ws.recv()
            assert isinstance(first, bytes) and len(first) > 0  # binary pcm frames
            assert engine.blocks_in_use > 0
            if leave == "cancel":
                ws.send(json.dumps({"type": "cancel"}))
                while (message := ws.recv()) != '{"type":"cancelled"}' and isinstance(
                    message, bytes
                ):
                    pass
            else:
                ws.close()
            left = time.perf_counter()
            while engine.blocks_in_use or served.runtime.conductor.active:
                assert time.perf_counter() - left < 3.0, f"speech outlived the {leave}"
                time.sleep(0.01)
            if leave == "cancel":  # the session goes on after a cancel
                ws.send(json.dumps({"type": "end"}))
                assert json.loads(ws.recv()) == {"type": "done"}
    assert served.admission.in_flight == 0


def _histogram_count(metrics: str, name: str, route: str) -> float:
    prefix = f'{name}_count{{model="orpheus",route="{route}"}} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_speech_records_time_to_first_audio_and_real_time_factor(live: Live) -> None:
    route = "/v1/audio/speech"
    before = http("GET", live.url + "/metrics").body.decode()
    audio = _speak(live, response_format="pcm")
    after = http("GET", live.url + "/metrics").body.decode()
    assert len(audio) > 0
    for name in ("mstar_time_to_first_audio_seconds", "mstar_real_time_factor"):
        grew = _histogram_count(after, name, route) - _histogram_count(before, name, route)
        assert grew == 1, name
    # A text-only request makes no audio, so it adds no TTFA sample.
    assert _histogram_count(after, "mstar_time_to_first_audio_seconds", "/generate") == 0
