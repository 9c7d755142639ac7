"""A real uvicorn server on a free port, in a thread with its own event loop, for client tests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette

#: The event loop serving each live server, by base URL (for ``server_tasks``).
_LOOPS: dict[str, asyncio.AbstractEventLoop] = {}


@contextmanager
def live_server(app: Starlette, *, loop: str = "asyncio") -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) and yield its base URL; stop it on exit.

    ``loop`` is uvicorn's: ``asyncio`` or ``uvloop``. Fails if the app does not start in 60 s.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, loop=loop, lifespan="on", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    event_loop = _new_loop(loop)
    thread = threading.Thread(
        target=event_loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start (see the log above)")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    _LOOPS[url] = event_loop
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        _LOOPS.pop(url, None)
        sock.close()
        if not thread.is_alive():
            event_loop.close()


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def server_tasks(url: str) -> int:
    """How many asyncio tasks the live server at ``url`` runs now (on its own loop)."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # this counting task

    return asyncio.run_coroutine_threadsafe(count(), _LOOPS[url]).result(timeout=10)


@dataclass
class Reply:
    """A plain HTTP reply: status, headers (lower-case names) and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: Any = None, *, timeout: float = 60) -> Reply:
    """One HTTP request with the standard library (a JSON ``body`` if given); any status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            headers = {k.lower(): v for k, v in response.headers.items()}
            return Reply(response.status, headers, response.read())
    except urllib.error.HTTPError as error:
        with error:  # it holds the connection: an unclosed one is a ResourceWarning later
            headers = {k.lower(): v for k, v in error.headers.items()}
            return Reply(error.code, headers, error.read())
