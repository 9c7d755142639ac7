"""A real uvicorn server on a free port, in a thread with its own event loop, for client tests."""

from __future__ import annotations

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
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


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
