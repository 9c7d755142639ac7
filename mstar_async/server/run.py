"""Running the app on uvicorn inside the caller's event loop, with a bounded shutdown."""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from mstar_async.logs import get_logger

#: Seconds running requests get to finish after SIGTERM or Ctrl-C before they are cancelled.
DRAIN_SECONDS = 10.0
#: Seconds past the drain that cancelling requests and stopping models may take before the
#: process exits anyway (a forward stuck in native code, a worker that does not answer).
STOP_SECONDS = 10.0

log = get_logger("mstar_async.server")


class _BoundedServer(uvicorn.Server):
    """uvicorn's server, plus a watchdog armed by the first stop signal: if the process has
    not exited ``drain_s + STOP_SECONDS`` later, it exits there (status 1). A thread, so a
    busy or stuck event loop cannot hold it up; worker processes die with their parent."""

    def __init__(self, config: uvicorn.Config, drain_s: float) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self._watchdog: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._watchdog is None:
            log.info("server.stopping", signal=sig, drain_s=self.drain_s)
            self._watchdog = threading.Timer(self.drain_s + STOP_SECONDS, _exit_now)
            self._watchdog.daemon = True
            self._watchdog.start()
        super().handle_exit(sig, frame)

    def disarm(self) -> None:
        """The server stopped in time: no forced exit."""
        if self._watchdog is not None:
            self._watchdog.cancel()


def _exit_now() -> None:
    log.error("server.stop_timeout", why="stopping took too long; exiting now")
    os._exit(1)


async def serve(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_s: float = DRAIN_SECONDS,
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or Ctrl-C. Then running requests get
    ``drain_s`` seconds to finish and new connections are refused; what still runs is
    cancelled, the models close (worker processes stop), and the call returns. Should that
    take more than ``STOP_SECONDS`` past the drain, the process exits with status 1.

    Runs in the event loop already running (asyncio or uvloop). uvicorn's own access log is
    off; the app logs through ``mstar_async.logs``.

    Raises:
        ValueError: ``drain_s`` is negative.
        SystemExit: the app failed to start (a model failed to load; uvicorn logs why).
    """
    if not drain_s >= 0:
        raise ValueError(f"drain_s must be >= 0, got {drain_s!r}")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(drain_s),  # uvicorn takes whole seconds
    )
    server = _BoundedServer(config, drain_s)
    with _sigterm_as_interrupt():
        try:
            await server.serve()
        finally:
            server.disarm()
    if not server.started:
        raise SystemExit(1)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    # uvicorn raises the stop signal again once it has shut down, for the default action; for
    # SIGTERM that would kill the process (status -15) after a clean stop. As Ctrl-C, it ends
    # the command with status 0.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
