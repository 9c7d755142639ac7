"""Routes about the server itself: ``/v1/models``, ``/health``, ``/metrics``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text format."""
    return Response(server_state(request).metrics.render(), media_type=PROMETHEUS_TEXT)


def routes() -> list[Route]:
    """The server's own routes."""
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _context_length(served: ServedModel) -> int | None:
    context = served.runtime.model.context
    return None if context is None else context.tokens
