"""``mstar serve`` as a user runs it: a child process on a free port, polled until healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.children import running
from tests.server.live import http


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def mstar_serve(*args: str, ready_within: float) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Run ``mstar serve ARGS`` on a free port; yield its URL and process once ``/health``
    answers. On exit a server still running gets Ctrl-C, then is killed after 30 s (see
    ``tests.children``: Ctrl-C reaches it however the suite was started)."""
    port = free_port()
    command = [sys.executable, "-m", "mstar_async.cli", "serve", *args, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running(command, stderr=subprocess.PIPE, text=True) as process:
        _wait_healthy(url, process, ready_within)
        yield url, process


def _wait_healthy(url: str, process: subprocess.Popen[str], within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        if process.poll() is not None:
            raise AssertionError(f"mstar serve exited: {process.communicate()[1]}")
        assert time.monotonic() < deadline, "mstar serve did not become healthy"
        try:
            if http("GET", f"{url}/health", timeout=1).status == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found
