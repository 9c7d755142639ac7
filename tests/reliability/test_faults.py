"""Faults injected into a live server: clients that leave all at once or read slowly, an engine
that raises or runs out of KV in the middle of a forward. Each test checks that nothing leaks
(KV blocks, requests, admission tickets, file descriptors, threads) and that the server
answers correctly afterwards."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from mstar_async.engines import Step, StepResult
from mstar_async.errors import KVCacheFull
from mstar_async.models import build_model
from mstar_async.server import ModelSpec, ServedModel, create_app
from tests.server.live import http as request
from tests.server.live import live_server, server_tasks
from tests.server.test_bad_requests import BAD

pytestmark = pytest.mark.timeout(120)

#: A streamed completion as long as the tiny model's 256 positions allow.
STREAM = {
    "model": "causal-lm",
    "prompt": "once upon",
    "max_tokens": 240,
    "stream": True,
    "ignore_eos": True,
}


class Faulty:
    """The served engine, with a fault armed from the test: ``fail_next`` makes the next
    forward raise that error (once)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_next: BaseException | None = None
        self.failed = 0

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        error, self.fail_next = self.fail_next, None
        if error is not None:
            self.failed += 1
            raise error
        return self.inner.forward(steps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Stream:
    """One streaming response on its own connection."""

    def __init__(self, conn: http.client.HTTPConnection, reply: http.client.HTTPResponse) -> None:
        self.conn = conn
        self.reply = reply

    def read(self, amount: int | None = None) -> bytes:
        return self.reply.read(amount)

    def close(self) -> None:
        """Leave: the connection closes without reading the rest."""
        self.reply.close()
        self.conn.close()


class Server:
    """A live server of the tiny causal-lm whose engine is ``Faulty``."""

    def __init__(self, url: str, served: ServedModel, engine: Faulty) -> None:
        self.url = url
        self.served = served
        self.engine = engine
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def open_stream(self, body: dict[str, Any] | None = None) -> Stream:
        """A streaming completion, read up to its first event."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body or STREAM),
            {"Content-Type": "application/json"},
        )
        stream = Stream(conn, conn.getresponse())
        try:
            assert stream.reply.status == 200, stream.read()
            assert stream.reply.readline().startswith(b"data: ")
        except BaseException:
            stream.close()
            raise
        return stream

    def answers(self) -> None:
        """A short request gets a whole, correct reply."""
        body = {"model": "causal-lm", "prompt": "we", "max_tokens": 3}
        reply = request("POST", f"{self.url}/v1/completions", body, timeout=60)
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["completion_tokens"] <= 3

    def wait_clean(self, fds: int, threads: int, tasks: int, within: float = 10.0) -> None:
        """Every request gone, every KV block and ticket back, fds, threads and the server
        loop's asyncio tasks at baseline."""
        deadline = time.monotonic() + within
        while True:
            state = self._state()
            running = server_tasks(self.url)
            if (
                state == (0, 0, 0)
                and _fds() <= fds + 2
                and threading.active_count() <= threads
                and running <= tasks
            ):
                return
            assert time.monotonic() < deadline, (
                f"after {within} s: (KV blocks, requests, tickets) {state}, "
                f"fds {_fds()} (baseline {fds}), threads {threading.active_count()} "
                f"(baseline {threads}), server tasks {running} (baseline {tasks})"
            )
            time.sleep(0.02)

    def _state(self) -> tuple[int, int, int]:
        runtime = self.served.runtime
        return (
            int(self.engine.inner.blocks_in_use),
            len(runtime.conductor.active),
            self.served.admission.in_flight,
        )


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


@pytest.fixture(scope="module")
def server(tiny_folder: Path) -> Iterator[Server]:
    model = build_model("causal-lm", path=str(tiny_folder), dtype="float32")
    app = create_app([ModelSpec(model)], max_concurrent=64)
    with live_server(app) as url:
        served: ServedModel = app.state.server.models["causal-lm"]
        engine = Faulty(served.runtime.batching.engines["lm"])
        served.runtime.batching.engines["lm"] = engine
        srv = Server(url, served, engine)
        srv.answers()  # warm: the first request builds what later ones reuse
        yield srv


def _baseline(server: Server) -> tuple[int, int, int]:
    server.wait_clean(fds=10_000, threads=10_000, tasks=10_000)
    return _fds(), threading.active_count(), server_tasks(server.url)


def test_a_storm_of_clients_leaving_mid_stream_leaks_nothing(server: Server) -> None:
    fds, threads, tasks = _baseline(server)
    streams = [server.open_stream() for _ in range(24)]
    assert server.served.runtime.conductor.active
    for reply in streams:  # all at once, without reading the rest
        reply.close()
    server.wait_clean(fds, threads, tasks)
    server.answers()


def test_a_slow_reader_does_not_hold_up_other_requests(server: Server) -> None:
    fds, threads, tasks = _baseline(server)
    slow = server.open_stream()
    slow.read(1)  # then nothing for a while: its buffers fill and its request waits
    started = time.monotonic()
    for _ in range(3):
        server.answers()
    assert time.monotonic() - started < 30
    slow.close()
    server.wait_clean(fds, threads, tasks)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("device lost"), KVCacheFull("no block left for this forward")],
    ids=["engine-raises", "kv-runs-out"],
)
def test_a_forward_that_fails_mid_stream_fails_its_requests_alone(
    server: Server, error: BaseException
) -> None:
    fds, threads, tasks = _baseline(server)
    streams = [server.open_stream() for _ in range(4)]
    failed_before = server.engine.failed
    server.engine.fail_next = error
    ended = []
    for reply in streams:
        body = reply.read().decode()  # the stream ends: with an error event, not a hang
        ended.append(body)
        reply.close()
    assert server.engine.failed == failed_before + 1
    assert any('"error"' in body for body in ended)
    for body in ended:
        assert body.rstrip().endswith("data: [DONE]") or '"error"' in body
    server.wait_clean(fds, threads, tasks)
    server.answers()


def test_bad_and_over_long_inputs_are_refused_and_leave_nothing(server: Server) -> None:
    fds, threads, tasks = _baseline(server)
    text_routes = ("/v1/completions", "/v1/chat/completions")
    bad = [
        (route, body)
        for route, body, _ in BAD
        if route in text_routes and isinstance(body, dict) and body.get("model") == "causal-lm"
    ]
    long_text = "word " * 20_000  # far past the tiny model's 256 positions
    bad += [
        ("/v1/completions", {"model": "causal-lm", "prompt": long_text, "max_tokens": 4}),
        (
            "/v1/chat/completions",
            {"model": "causal-lm", "messages": [{"role": "user", "content": long_text}]},
        ),
        ("/generate", {"model": "causal-lm", "inputs": {"prompt": long_text}}),
    ]
    assert len(bad) >= 15
    for route, body in bad:
        reply = request("POST", server.url + route, body, timeout=60)
        assert 400 <= reply.status < 500, (route, reply.body[:200])
    server.wait_clean(fds, threads, tasks)
    server.answers()
