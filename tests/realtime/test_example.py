"""``examples/realtime_client.py`` against a live server of the tiny qwen3-omni: a typed turn's
spoken reply is written to a WAV file and its transcript printed; a spoken turn from a WAV
file is found by server VAD (or committed by hand) and answered the same way."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import soundfile as sf

from mstar_async.models import build_model
from mstar_async.server.app import create_app
from mstar_async.server.served import ModelSpec
from tests.realtime.audio import sentence, with_silence
from tests.server.live import live_server

pytestmark = pytest.mark.timeout(120)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "realtime_client.py"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(create_app([ModelSpec(build_model("qwen3-omni"))])) as base:
        yield base


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("realtime_client", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["realtime_client"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["realtime_client"]


def run(example: ModuleType, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = example.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_typed_turn_writes_the_spoken_reply_and_prints_its_transcript(
    example: ModuleType, url: str, tmp_path: Path
) -> None:
    reply = tmp_path / "reply.wav"
    code, out, err = run(
        example, "--url", url, "--text", "Tell me a story", "--out", str(reply), "--max-tokens", "6"
    )
    assert code == 0, err
    with wave.open(str(reply)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24_000, 1, 2)
        frames = wav.getnframes()
    assert frames > 24_000 // 10
    assert out.strip()  # the transcript
    assert f"{frames / 24_000:.2f} s of speech written" in err


@pytest.mark.parametrize("how", ["vad", "commit"])
def test_a_spoken_turn_writes_the_spoken_reply(
    example: ModuleType, url: str, tmp_path: Path, how: str
) -> None:
    question = tmp_path / "question.wav"  # 16 kHz stereo: the example converts it
    mono = with_silence(sentence("weather", 16_000), 0.4, 0.2, 16_000)
    sf.write(question, [[s, s] for s in mono], 16_000, subtype="PCM_16")
    reply = tmp_path / "r.wav"
    argv = ["--url", url, "--wav", str(question), "--out", str(reply), "--fast"]
    argv += ["--max-tokens", "8"]
    code, out, err = run(example, *argv, *(["--commit"] if how == "commit" else []))
    assert code == 0, err
    if how == "vad":
        started = int(err.split("speech started at ")[1].split(" ms")[0])
        assert 0 <= started <= 400  # the speech begins at 400 ms; 300 ms of prefix padding
        assert "speech stopped at" in err
    else:
        assert "speech started" not in err
    with wave.open(str(reply)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnframes() > 24_000 // 10
    assert out.strip()  # the transcript
