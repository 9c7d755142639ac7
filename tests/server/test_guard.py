"""The guard in front of every route: API key, Host allowlist, body size limit."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import AuthenticationError, OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from mstar_async.server.guard import LOOPBACK_HOSTS, Guard, hosts_to_answer
from tests.server.live import live_server

pytestmark = [pytest.mark.timeout(120)]


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"bytes": len(await request.body())})


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


@contextmanager
def guarded(**options: Any) -> Iterator[tuple[str, int]]:
    """A real server (uvicorn on 127.0.0.1) of a two-route app behind ``Guard(**options)``."""
    app = Starlette(routes=[Route("/echo", _echo, methods=["POST"]), Route("/health", _health)])
    with live_server(Guard(app, **options)) as url:  # type: ignore[arg-type]
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def call(
    server: tuple[str, int],
    method: str,
    path: str,
    body: bytes | Iterator[bytes] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request with the standard library's client; ``(status, JSON body)``. An iterator
    body goes out chunked (no Content-Length)."""
    connection = http.client.HTTPConnection(*server, timeout=30)
    try:
        chunked = body is not None and not isinstance(body, bytes)
        connection.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def test_an_api_key_is_required_everywhere_but_the_liveness_probe() -> None:
    with guarded(api_key="s3cret") as server:
        status, body = call(server, "POST", "/echo", b"x")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert "Bearer" in body["error"]["message"]
        wrong = call(server, "POST", "/echo", b"x", {"Authorization": "Bearer no"})
        assert wrong[0] == 401
        good = call(server, "POST", "/echo", b"x", {"Authorization": "Bearer s3cret"})
        assert good == (200, {"bytes": 1})
        assert call(server, "GET", "/health")[0] == 200


def test_a_host_not_allowed_is_refused_before_any_route() -> None:
    with guarded(allowed_hosts=LOOPBACK_HOSTS) as server:
        assert call(server, "POST", "/echo", b"x")[0] == 200  # Host: 127.0.0.1:port
        status, body = call(server, "POST", "/echo", b"x", {"Host": "evil.example:8000"})
        assert status == 400 and "evil.example" in body["error"]["message"]
        assert call(server, "POST", "/echo", b"x", {"Host": "localhost:8000"})[0] == 200
        assert call(server, "POST", "/echo", b"x", {"Host": "[::1]:8000"})[0] == 200


def test_a_body_over_the_limit_is_413_declared_or_streamed() -> None:
    with guarded(max_body_bytes=1000) as server:
        assert call(server, "POST", "/echo", b"x" * 1000) == (200, {"bytes": 1000})
        status, body = call(server, "POST", "/echo", b"x" * 1001)
        assert status == 413 and "larger than 1000 bytes" in body["error"]["message"]
        streamed = call(server, "POST", "/echo", iter([b"y" * 400] * 5))
        assert streamed[0] == 413


def test_loopback_servers_answer_loopback_names_only_by_default() -> None:
    assert set(hosts_to_answer(None, "127.0.0.1") or []) >= {"localhost", "127.0.0.1", "::1"}
    assert hosts_to_answer(None, "0.0.0.0") is None
    assert hosts_to_answer("*", "127.0.0.1") is None
    assert hosts_to_answer("a.example, b.example", "0.0.0.0") == ["a.example", "b.example"]


def test_the_openai_client_needs_the_key_on_a_live_server(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    app = create_app([ModelSpec(model)], api_key="k-123", allowed_hosts=LOOPBACK_HOSTS)
    with live_server(app) as url:
        with OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(AuthenticationError):
                client.models.list()
        with OpenAI(base_url=f"{url}/v1", api_key="k-123", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["causal-lm"]


def test_json_nested_too_deeply_is_a_400_naming_the_problem(tiny_folder: Path) -> None:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    with live_server(create_app([ModelSpec(model)])) as url:
        host, port = url.removeprefix("http://").split(":")
        deep = b'{"model": "causal-lm", "inputs": {"prompt": ' + b"[" * 10_000 + b"]" * 10_000
        status, body = call((host, int(port)), "POST", "/generate", deep + b"}}")
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        status, body = call((host, int(port)), "POST", "/v1/completions", b"[" * 10_000)
        assert 400 <= status < 500
