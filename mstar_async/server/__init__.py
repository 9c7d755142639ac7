"""HTTP serving: an ASGI app with OpenAI-compatible routes and native streaming routes.

    create_app([ModelSpec(build_model("causal-lm"))], max_concurrent=64)  ->  Starlette app
    await serve(app, host="127.0.0.1", port=8000)                         ->  uvicorn, this loop

Routes (see docs/http.md): ``GET /v1/models``, ``GET /health``, ``GET /health/ready``,
``GET /metrics``, ``POST /v1/chat/completions`` (text, or text and speech),
``POST /v1/completions``, ``POST /v1/audio/speech``, ``POST /v1/images/generations``, the
websocket ``/v1/audio/speech/stream``, ``POST /generate``.
"""

from __future__ import annotations

from mstar_async.server.app import ROUTE_MODULES, create_app
from mstar_async.server.errors import APIError
from mstar_async.server.run import serve
from mstar_async.server.served import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_TEXT_CHARS,
    ModelSpec,
    ServedModel,
)

__all__ = [
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_MAX_TEXT_CHARS",
    "ROUTE_MODULES",
    "APIError",
    "ModelSpec",
    "ServedModel",
    "create_app",
    "serve",
]
