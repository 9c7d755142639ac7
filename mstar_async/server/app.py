"""The ASGI app: routes from small modules, models opened for the app's lifetime.

A route module exposes ``routes() -> list[Route]`` and reaches the served models through
``server_state(request)``; serving a new kind of output (speech) is one more module in
``ROUTE_MODULES``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from mstar_async.errors import MstarError
from mstar_async.logs import get_logger
from mstar_async.models import build_model
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.server import (
    admin,
    generate,
    images,
    openai_text,
    realtime,
    speech,
    speech_stream,
    voices,
)
from mstar_async.server.admission import Admission
from mstar_async.server.errors import (
    APIError,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
    handle_validation_error,
)
from mstar_async.server.guard import DEFAULT_MAX_BODY_BYTES, Guard
from mstar_async.server.readiness import DEFAULT_STALL_SECONDS
from mstar_async.server.served import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_TEXT_CHARS,
    ModelSpec,
    ServedModel,
)
from mstar_async.server.state import ServerState
from mstar_async.voices import VoiceLimits, VoiceRegistry, VoiceStore

log = get_logger("mstar_async.server")

#: Every route module the app mounts, in order.
ROUTE_MODULES: tuple[Callable[[], Sequence[BaseRoute]], ...] = (
    admin.routes,
    openai_text.routes,
    speech.routes,
    speech_stream.routes,
    realtime.routes,
    images.routes,
    generate.routes,
    voices.routes,
)


def create_app(
    models: Sequence[ModelSpec],
    *,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    progress: Callable[[str], None] | None = None,
    api_key: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    stall_after_s: float = DEFAULT_STALL_SECONDS,
    voices_dir: str | Path | None = None,
    voice_limits: VoiceLimits | None = None,
) -> Starlette:
    """An ASGI app serving ``models``; each is opened (``open_runtime``) when the app starts
    and closed when it stops, in the host's event loop.

    ``max_concurrent`` bounds the in-flight requests of each model that sets no bound of its
    own; past it the app answers 429. ``max_text_chars`` bounds the speech text of one request
    of each model that sets no bound of its own; past it, or past a model's context limit, the
    app answers 400 before admitting the request (``limits``). ``progress`` receives a line as
    each model loads. ``api_key``, ``allowed_hosts`` and ``max_body_bytes`` are checked on
    every request before any route sees it (see ``Guard``: 401, 400, 413). ``stall_after_s``:
    a model whose steps wait that long with no forward finishing is not ready
    (``/health/ready`` answers 503). ``voices_dir`` keeps the voices registered with
    ``/v1/audio/voices`` for every served model that clones voices (safetensors and a JSON
    index, shared by every process given the same directory), within ``voice_limits``.

    Raises:
        ValueError: no models, two under one name, a bound below 1, ``stall_after_s`` not
            positive, or a model with ``make_launcher`` but no placement.
    """
    if not models:
        raise ValueError("serve at least one model")
    names = [spec.served_name for spec in models]
    if len(set(names)) != len(names):
        raise ValueError(f"two models share a name in {names}: give one ModelSpec(name=...)")
    limits = {spec.served_name: spec.max_concurrent or max_concurrent for spec in models}
    chars = {spec.served_name: spec.max_text_chars or max_text_chars for spec in models}
    for name in names:
        for option, bound in (("max_concurrent", limits), ("max_text_chars", chars)):
            if bound[name] < 1:
                raise ValueError(f"{option} of {name!r} must be >= 1, got {bound[name]}")
    for spec in models:
        if spec.make_launcher is not None and spec.placement is None:
            raise ValueError(f"{spec.served_name!r} has a launcher but no placement: give one")
    if not stall_after_s > 0:
        raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
    state = ServerState(stall_after_s=stall_after_s)
    store = None if voices_dir is None else VoiceStore(voices_dir, voice_limits)
    say = progress or (lambda line: None)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for spec in models:
                name = spec.served_name
                say(f"loading {name} ...")
                started = time.perf_counter()
                launcher = None if spec.make_launcher is None else spec.make_launcher()
                runtime = await stack.enter_async_context(
                    open_runtime(spec.model, placement=spec.placement, launcher=launcher)
                )
                served = ServedModel(name, runtime, Admission(limits[name]), chars[name])
                state.models.add(served)
                if store is not None and runtime.model.info.get("clones_voices"):
                    runtime.voices = state.voices[name] = VoiceRegistry(store, name)
                say(f"{name} ready in {time.perf_counter() - started:.1f} s")
                log.info("server.model_ready", model=name)
            state.vad = await _open_vad(stack, state, say)
            state.ready = True
            say(f"ready: {', '.join(state.models)}")
            try:
                yield
            finally:
                state.ready = False

    guard = Middleware(
        Guard, api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes
    )
    app = Starlette(
        routes=[route for module in ROUTE_MODULES for route in module()],
        middleware=[guard],
        lifespan=lifespan,
        exception_handlers={
            APIError: handle_api_error,
            msgspec.ValidationError: handle_validation_error,
            msgspec.DecodeError: handle_validation_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    app.state.server = state
    return app


async def _open_vad(
    stack: AsyncExitStack, state: ServerState, say: Callable[[str], None]
) -> Runtime | None:
    """The ``silero-vad`` runtime realtime sessions share, where a served model can hold a
    realtime conversation; None elsewhere, or when the VAD cannot load (sessions then commit
    their audio by hand, and say so)."""
    if not any("messages" in served.inputs for served in state.models.values()):
        return None
    try:
        runtime = await stack.enter_async_context(open_runtime(build_model("silero-vad")))
    except MstarError as exc:
        log.warning("server.vad_unavailable", error=str(exc))
        say(f"server VAD unavailable: {exc}")
        return None
    return runtime
