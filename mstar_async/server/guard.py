"""``Guard``: what every request must pass before any route sees it.

Three checks, in order, each answered in the OpenAI error shape before a byte of the body is
read by a route:

- the ``Host`` header must name an allowed host (a page in a browser can otherwise reach a
  server on loopback through DNS rebinding): 400;
- with an API key set, every route but the health probes needs ``Authorization: Bearer
  <key>``: 401 (compared in constant time); a websocket may offer the key as the subprotocol
  ``openai-insecure-api-key.<key>`` instead, as browsers (which cannot set headers on a
  websocket) do for the Realtime API;
- a request body may not exceed ``max_body_bytes``: 413, from ``Content-Length`` at once, or as
  soon as a chunked body passes the limit.

Websocket handshakes get the first two checks and are closed with policy-violation code 1008.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The default request body limit: a few MB, enough for a base64 image or a short audio clip.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Host names a server bound to loopback answers to by default.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: Paths served without an API key: the liveness and readiness probes, which an orchestrator
#: asks without credentials and which tell no more than whether the models are served.
OPEN_PATHS = frozenset({"/health", "/health/ready"})
#: The subprotocol prefix OpenAI's browser clients carry the key in on a websocket.
KEY_SUBPROTOCOL = "openai-insecure-api-key."


def hosts_to_answer(option: str | None, bind_host: str) -> list[str] | None:
    """The Host names to answer: ``option``'s comma list ('*': any), else the loopback names
    when the server binds a loopback address (DNS rebinding), else any (None)."""
    if option is not None:
        names = [name.strip() for name in option.split(",") if name.strip()]
        return None if "*" in names else names
    if bind_host in LOOPBACK_HOSTS or bind_host.startswith("127."):
        return [*LOOPBACK_HOSTS, bind_host]
    return None


class Guard:
    """ASGI middleware applying the checks in the module docstring to ``app``.

    ``allowed_hosts`` of None allows any host; names compare case-insensitively without the
    port. ``api_key`` of None (or "") turns the key check off.

    Raises:
        ValueError: ``max_body_bytes`` is below 1.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None = None,
        allowed_hosts: Iterable[str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_key = api_key or None
        self.allowed_hosts = (
            None
            if allowed_hosts is None
            else frozenset(h.lower().strip("[]") for h in allowed_hosts)
        )
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, param = refusal
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            else:
                await _error(send, status, message, param)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _error(send, 413, self._too_large(), "body")
            return
        await self._limited(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str | None] | None:
        if self.allowed_hosts is not None:
            host = _hostname(_header(scope, b"host") or "")
            if host not in self.allowed_hosts:
                return (
                    400,
                    f"host {host!r} is not served here; allowed hosts: "
                    f"{sorted(self.allowed_hosts)} (mstar serve --allowed-hosts)",
                    "Host",
                )
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            given = _header(scope, b"authorization") or ""
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer":
                scheme, token = "bearer", _subprotocol_key(scope) or ""
            if not token or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return (
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with",
                    "Authorization",
                )
        return None

    def _too_large(self) -> str:
        return (
            f"request body larger than {self.max_body_bytes} bytes; send less "
            "(mstar serve --max-body-bytes raises the limit)"
        )

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A chunked body is counted as it arrives; past the limit the client gets its 413 at
        # once and the app sees the client gone (whatever it then answers is dropped).
        seen = 0
        started = refused = False

        async def counting_receive() -> Message:
            nonlocal seen, started, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    refused = True
                    if not started:
                        started = True
                        await _error(send, 413, self._too_large(), "body")
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except Exception:
            if not refused:
                raise


def _subprotocol_key(scope: Scope) -> str | None:
    """The key a browser's websocket offers as the subprotocol ``openai-insecure-api-key.KEY``
    (a browser cannot set an Authorization header on a websocket); None for HTTP."""
    if scope["type"] != "websocket":
        return None
    for protocol in scope.get("subprotocols") or ():
        if protocol.startswith(KEY_SUBPROTOCOL):
            key: str = protocol[len(KEY_SUBPROTOCOL) :]
            return key
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _error(send: Send, status: int, message: str, param: str | None) -> None:
    kind = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error"}
    body: dict[str, Any] = {
        "error": {
            "message": message,
            "type": kind.get(status, "error"),
            "param": param,
            "code": None,
        }
    }
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
