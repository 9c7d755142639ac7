"""What every route of one server shares: the served models and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

from mstar_async.server.metrics import ServerMetrics
from mstar_async.server.readiness import DEFAULT_STALL_SECONDS
from mstar_async.server.served import ServedModels

if TYPE_CHECKING:
    from mstar_async.runtime import Runtime
    from mstar_async.voices import VoiceRegistry


@dataclass
class ServerState:
    """The served models (filled while the app starts), the server's metrics, how long
    steps may wait without a forward before ``/health/ready`` says 503, and the ``silero-vad``
    runtime realtime sessions share (None until opened, or where it cannot be)."""

    models: ServedModels = field(default_factory=ServedModels)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    ready: bool = False
    stall_after_s: float = DEFAULT_STALL_SECONDS
    vad: Runtime | None = None
    #: Registered voices per served model that clones voices (``create_app(voices_dir=...)``).
    voices: dict[str, VoiceRegistry] = field(default_factory=dict)


def server_state(request: HTTPConnection) -> ServerState:
    """The state of the app serving ``request`` (an HTTP request or a websocket)."""
    state: ServerState = request.app.state.server
    return state
