"""``/v1/audio/voices`` and cloned-voice speech through real clients: a plain multipart upload
(built by hand) registers a voice, the ``openai`` client speaks with its id, inline ``ref_audio``
clones for one request, every limit answers a clear 4xx, ``repetition_penalty`` reaches the
talker, and a restarted server (a new app over the same directory) still has the voice."""

from __future__ import annotations

import base64
import io
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import soundfile
import torch

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from mstar_async.voices import VoiceLimits
from tests.server.conftest import Live, openai_client
from tests.server.live import Reply, http, live_server

pytestmark = pytest.mark.timeout(60)

LIMITS = VoiceLimits(max_voices=2, max_audio_seconds=2.0, max_upload_bytes=200_000)
SPEECH = {"seed": 1, "max_tokens": 6}  # 6 frames of 1920 samples


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    t = torch.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * torch.sin(2 * torch.pi * 220 * t)).numpy(), rate, format="WAV")
    return buffer.getvalue()


def _app(voices: Path) -> Any:
    return create_app(
        [ModelSpec(build_model("qwen3-tts", size="tiny", chunk=4))],
        voices_dir=voices,
        voice_limits=LIMITS,
    )


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def live(voices_dir: Path) -> Iterator[Live]:
    torch.set_num_threads(1)
    app = _app(voices_dir)
    with live_server(app) as url, openai_client(url) as client:
        yield Live(url, app, client)


def _register(url: str, audio: bytes | None, **fields: str) -> Reply:
    """A plain multipart/form-data upload, built by hand as any HTTP client sends it."""
    boundary = "----mstar-test-boundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    if audio is not None:
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="ref.wav"'
            "\r\nContent-Type: audio/wav\r\n\r\n"
        )
        parts.append(head.encode() + audio + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"{url}/v1/audio/voices", data=body, method="POST")
    request.add_header("content-type", f"multipart/form-data; boundary={boundary}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Reply(response.status, {}, response.read())
    except urllib.error.HTTPError as error:
        with error:
            return Reply(error.code, {}, error.read())


def _speak(live: Live, voice: str, **extra: Any) -> bytes:
    with live.client.audio.speech.with_streaming_response.create(
        model="qwen3-tts",
        voice=voice,
        input="Hello there.",
        response_format="pcm",
        extra_body={**SPEECH, **extra},
    ) as response:
        return b"".join(response.iter_bytes(4096))


def test_register_speak_list_delete(live: Live, voices_dir: Path) -> None:
    reply = _register(live.url, _wav(1.0), name="Ada", transcript="A short test.")
    assert reply.status == 200, reply.body
    voice = reply.json()
    assert voice["object"] == "audio.voice" and voice["id"].startswith("voice_")
    assert voice["name"] == "Ada" and voice["frames"] == 13 and voice["model"] == "qwen3-tts"
    pcm = _speak(live, voice["id"])
    assert len(pcm) == 6 * 1920 * 2  # 16-bit samples
    talker = live.app.state.server.models["qwen3-tts"].runtime.batching.engines["talker"]
    deadline = time.monotonic() + 10
    while f"voice:{voice['id']}" not in talker.handles:  # kept once the request is released
        assert time.monotonic() < deadline, talker.handles
        time.sleep(0.005)
    listed = http("GET", f"{live.url}/v1/audio/voices").json()
    assert [v["id"] for v in listed["data"]] == [voice["id"]]
    assert sorted(p.name for p in voices_dir.iterdir()) == [
        ".lock",
        "index.json",
        f"{voice['id']}.safetensors",
    ]
    gone = http("DELETE", f"{live.url}/v1/audio/voices/{voice['id']}")
    assert gone.json() == {"id": voice["id"], "object": "audio.voice.deleted", "deleted": True}
    assert sorted(p.name for p in voices_dir.iterdir()) == [".lock", "index.json"]
    assert talker.handles == {}  # its kept KV went with it
    with pytest.raises(openai.BadRequestError) as caught:
        _speak(live, voice["id"])
    assert "no voice" in str(caught.value)


def test_inline_ref_audio_clones_for_one_request(live: Live) -> None:
    data = base64.b64encode(_wav(1.0)).decode()
    pcm = _speak(live, "", ref_audio=data, ref_text="A short test.")
    assert len(pcm) == 6 * 1920 * 2
    with pytest.raises(openai.BadRequestError, match="not both"):
        _speak(live, "ryan", ref_audio=data)
    with pytest.raises(openai.BadRequestError, match="base64"):
        _speak(live, "", ref_audio="/etc/passwd")


def test_repetition_penalty_reaches_the_talker(live: Live) -> None:
    default = _speak(live, "ryan")
    # Upstream's default penalty is the program's: the same speech as when it is given.
    assert _speak(live, "ryan", repetition_penalty=1.05) == default
    # Seeded: only the penalty differs, and a strong one changes what is said.
    assert _speak(live, "ryan", repetition_penalty=3.0) != default
    with pytest.raises(openai.BadRequestError) as caught:
        _speak(live, "ryan", repetition_penalty=0)
    assert caught.value.param == "repetition_penalty"


def test_limits_answer_clear_4xx_before_any_work(live: Live) -> None:
    cases = [
        (_register(live.url, _wav(3.0), name="long"), 413, "at most 2 s"),
        (_register(live.url, b"\0" * 300_000, name="big"), 413, "at most 200000"),
        (_register(live.url, b"not audio", name="junk"), 400, "not an audio file"),
        (_register(live.url, _wav(1.0)), 400, "name"),
        (_register(live.url, None, name="none"), 400, "'file'"),
        (_register(live.url, _wav(1.0), name="x" * 65), 413, "at most 64"),
        (http("POST", f"{live.url}/v1/audio/voices", {"name": "x"}), 400, "multipart"),
        (http("DELETE", f"{live.url}/v1/audio/voices/voice_..index"), 404, "no voice"),
    ]
    for reply, status, words in cases:
        assert reply.status == status, reply.body
        assert words in reply.json()["error"]["message"]
    made = [_register(live.url, _wav(0.3), name=f"v{i}").json()["id"] for i in range(2)]
    full = _register(live.url, _wav(0.3), name="third")
    assert full.status == 409 and "limit of 2 voices" in full.json()["error"]["message"]
    for voice in made:
        assert http("DELETE", f"{live.url}/v1/audio/voices/{voice}").status == 200


def test_voices_survive_a_restart(tmp_path: Path) -> None:
    with live_server(_app(tmp_path)) as url:
        voice = _register(url, _wav(1.0), name="kept", transcript="A short test.").json()["id"]
    with live_server(_app(tmp_path)) as url, openai_client(url) as client:
        assert [v["id"] for v in http("GET", f"{url}/v1/audio/voices").json()["data"]] == [voice]
        live = Live(url, None, client)  # type: ignore[arg-type]
        assert len(_speak(live, voice)) == 6 * 1920 * 2
