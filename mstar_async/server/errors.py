"""Errors as HTTP responses, in the OpenAI error shape.

Every error body is ``{"error": {"message", "type", "param", "code"}}``: ``param`` names the
request field at fault (``messages[0].content``) or is null.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mstar_async.logs import get_logger

log = get_logger("mstar_async.server")

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    501: "not_implemented",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered as an HTTP response: status, message, and the field at fault.

    ``code`` is OpenAI's machine-readable code where one applies (``context_length_exceeded``);
    ``headers`` go on the response (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> Response:
        """This error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A 400 naming the field msgspec rejected, e.g. ``param="messages[0].role"``."""
    text = str(exc)
    where = _AT.search(text)
    path = where.group("path") if where else ""
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    message = text if isinstance(exc, msgspec.ValidationError) else f"invalid JSON body: {text}"
    return APIError(400, message, param=path or None)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    """Starlette handler for ``APIError``; counts the response in the server's metrics."""
    assert isinstance(exc, APIError)
    _count(request, exc.status)
    return exc.response()


async def handle_validation_error(request: Request, exc: Exception) -> Response:
    """Starlette handler for msgspec's validation and decode errors (400 naming the field)."""
    assert isinstance(exc, msgspec.ValidationError | msgspec.DecodeError)
    error = from_validation(exc)
    _count(request, error.status)
    return error.response()


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette handler for routing errors (unknown path, wrong method) in the same shape."""
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Starlette handler for anything else: a 500 that names the error type, logged."""
    log.error("server.error", path=request.url.path, error=repr(exc))
    _count(request, 500)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def _count(request: Request, status: int) -> None:
    state = getattr(request.app.state, "server", None)
    if state is not None:
        model = getattr(request.state, "model", "")
        state.metrics.count(model, request.url.path, status)
