"""Routes about the server itself: ``/v1/models``, ``/health``, ``/health/ready``, ``/metrics``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mstar_async.server.readiness import model_stats, unready_models
from mstar_async.server.served import ServedModel
from mstar_async.server.state import server_state

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the served models, OpenAI's list shape plus each program's inputs."""
    models = server_state(request).models
    data = [
        {
            "id": name,
            "object": "model",
            "created": served.created,
            "owned_by": "mstar_async",
            "description": served.runtime.model.description,
            "inputs": served.inputs,
            "info": dict(served.runtime.model.info),
            "max_concurrent": served.admission.limit,
            "context_length": _context_length(served),
            "max_text_chars": served.max_text_chars if served.speaks else None,
        }
        for name, served in models.items()
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    """``GET /health``: 200 with the in-flight count per model once every model is loaded."""
    state = server_state(request)
    body = {
        "status": "ok" if state.ready else "loading",
        "models": {name: {"in_flight": s.admission.in_flight} for name, s in state.models.items()},
    }
    return JSONResponse(body, status_code=200 if state.ready else 503)


async def ready(request: Request) -> Response:
    """``GET /health/ready``: 200 when every model can make progress; 503 with the reason per
    model while one cannot (a worker rank down or restarting, steps waiting with no forward
    finishing for ``stall_after_s``), and while the models load or the server stops."""
    state = server_state(request)
    if not state.ready:
        return JSONResponse({"status": "loading", "models": {}}, status_code=503)
    unready = unready_models(await model_stats(state.models), state.stall_after_s)
    models: dict[str, Any] = {
        name: {"ready": False, "reason": unready[name]} if name in unready else {"ready": True}
        for name in state.models
    }
    status = 503 if unready else 200
    return JSONResponse({"status": "unready" if unready else "ready", "models": models}, status)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text format; every model's ranks are asked for their
    counters first (``Runtime.stats()``)."""
    state = server_state(request)
    body = state.metrics.render(await model_stats(state.models))
    return Response(body, media_type=PROMETHEUS_TEXT)


def routes() -> list[Route]:
    """The server's own routes."""
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _context_length(served: ServedModel) -> int | None:
    context = served.runtime.model.context
    return None if context is None else context.tokens
