"""Running the app on uvicorn inside the caller's event loop."""

from __future__ import annotations

import uvicorn
from starlette.applications import Starlette

SHUTDOWN_GRACE_SECONDS = 5


async def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` on ``host:port`` until interrupted (Ctrl-C / SIGTERM end it cleanly:
    running requests get ``SHUTDOWN_GRACE_SECONDS`` to finish, then are cancelled).

    Runs in the event loop already running (asyncio or uvloop). uvicorn's own access log is
    off; the app logs through ``mstar_async.logs``.

    Raises:
        SystemExit: the app failed to start (a model failed to load; uvicorn logs why).
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )
    server = uvicorn.Server(config)
    await server.serve()
    if not server.started:
        raise SystemExit(1)
