"""SIGTERM under load: ``mstar serve`` drains for ``--drain-seconds``, then stops every request
and worker process and exits, in bounded time, whatever its clients are doing."""

from __future__ import annotations

import http.client
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.server.process import alive, children, mstar_serve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
DRAIN = 2.0
#: What stopping may take past the drain: cancel the requests, stop the workers, exit.
STOP_MARGIN = 10.0


def _stream(url: str, path: str, body: bytes, started: threading.Event) -> None:
    request = urllib.request.Request(
        f"{url}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read(1)
            started.set()
            while reply.read(16384):
                time.sleep(0.01)  # a slowish reader: the server must not wait for it
    except (OSError, http.client.HTTPException):
        started.set()  # cut off by the shutdown: what this test expects


def _load(url: str, work: list[tuple[str, bytes]]) -> list[threading.Thread]:
    """A thread streaming each (path, body) of ``work``, once every one has started."""
    threads, started = [], []
    for path, body in work:
        event = threading.Event()
        thread = threading.Thread(target=_stream, args=(url, path, body, event), daemon=True)
        thread.start()
        threads.append(thread)
        started.append(event)
    for event in started:
        assert event.wait(60), "a request never started streaming"
    return threads


SPEECH = b'{"model":"orpheus","input":"' + b"word " * 200 + b'","max_tokens":4000}'
TEXT = b'{"model":"causal-lm","prompt":"once","max_tokens":4000,"stream":true}'
DEMO = b'{"model":"demo","inputs":{"text":"long","max_codes":100000,"steps":2}}'
IN_PROCESS = [("/v1/audio/speech", SPEECH)] * 3 + [("/v1/completions", TEXT)] * 3
WORKERS = [("/generate", DEMO)] * 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize("placement", [None, "codec_split.yaml"], ids=["in-process", "workers"])
def test_sigterm_under_load_drains_then_exits_in_bounded_time(
    tiny_folder: Path, placement: str | None
) -> None:
    args = ["causal-lm", "orpheus", "--drain-seconds", str(DRAIN)]
    if placement is not None:
        args = ["demo", "--drain-seconds", str(DRAIN), "--placement", str(EXAMPLES / placement)]
    with mstar_serve(*args, ready_within=120) as (url, process):
        workers = children(process.pid)
        if placement is not None:
            assert workers, "the placement should have started worker processes"
        threads = _load(url, IN_PROCESS if placement is None else WORKERS)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(DRAIN + STOP_MARGIN + 20)
        took = time.monotonic() - sent
    assert code == 0
    assert took <= DRAIN + STOP_MARGIN, f"stopping took {took:.1f} s"
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a worker process outlived the server"
