"""Websocket ``/v1/realtime?model=NAME``: the OpenAI Realtime API over a served model that reads
chat messages (qwen3-omni: text and speech out; a text model: text out).

Events are JSON text frames, as the API defines them (``mstar_async.realtime``); a client that
sends ``OpenAI-Beta: realtime=v1`` (or, from a browser, offers the subprotocol
``openai-beta.realtime-v1``) gets the beta event names. Each response is one request of
the model, admitted like any other (a model at its in-flight bound fails the response, with
``rate_limit_exceeded`` in its ``status_details``, and the session goes on). Server VAD runs
on the ``silero-vad`` model the server opens beside the served ones. A model that hears
(``info["audio_input_rate"]``) also gets one ``encode_only`` request per user turn, fed the
turn's speech while it is spoken; these are not counted against the model's in-flight bound
(they hold no KV cache), as the VAD's are not. A model whose program takes ``session`` keeps
the conversation's KV between the session's responses (each response passes the session's id),
rolls it back when an earlier item changes (``rewind``: a truncated reply's memory comes back at
the truncate event) and frees it when the session ends. A model that also takes ``warm``
prefills a spoken turn while it is spoken (``realtime/warm.py``): at most one such request per
session, not counted against the in-flight bound and none while the model is at it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from mstar_async.errors import MstarError
from mstar_async.logs import get_logger
from mstar_async.realtime.config import SessionConfig
from mstar_async.realtime.events import RealtimeError, new_id
from mstar_async.realtime.hearing import Hear, HeardTurn
from mstar_async.realtime.session import RealtimeSession
from mstar_async.realtime.warm import Warm, WarmTurn
from mstar_async.server.errors import APIError
from mstar_async.server.served import ServedModel
from mstar_async.server.speech_models import voice_inputs
from mstar_async.server.state import ServerState, server_state
from mstar_async.server.tracked import TrackedRequest

ROUTE = "/v1/realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
POLICY_VIOLATION = 1008
#: The largest client event frame (an append of 15 MiB of audio is ~20 MiB of base64).
MAX_EVENT_BYTES = 21 * 1024 * 1024

log = get_logger("mstar_async.server.realtime")


class _Reply:
    """One response's request: its outputs, then its usage."""

    def __init__(self, tracked: TrackedRequest) -> None:
        self.tracked = tracked

    def outputs(self) -> AsyncIterator[Any]:
        return self.tracked.outputs()

    def usage(self) -> dict[str, int]:
        metrics = self.tracked.stream.metrics
        prompt, completion = metrics.prompt_tokens or 0, metrics.completion_tokens or 0
        return {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
        }


def _turn_inputs(
    served: ServedModel, session_id: str, messages: list[dict[str, Any]], config: SessionConfig
) -> dict[str, Any]:
    """A response's program inputs for ``messages`` under ``config``.

    Raises:
        APIError: 400 when the model lacks the session's voice.
    """
    inputs: dict[str, Any] = {"messages": messages, "max_tokens": config.max_output_tokens}
    if "session" in served.inputs:  # the model keeps the conversation's KV between turns
        inputs["session"] = session_id
    if "temperature" in served.inputs:
        inputs["temperature"] = config.temperature
    if "speak" in served.inputs:
        inputs["speak"] = config.speaks
    if config.speaks:
        inputs.update(voice_inputs(served, config.voice))
    return inputs


def _responder(state: ServerState, served: ServedModel, session_id: str) -> Any:
    @asynccontextmanager
    async def respond(
        messages: list[dict[str, Any]], config: SessionConfig
    ) -> AsyncIterator[_Reply]:
        try:
            inputs = _turn_inputs(served, session_id, messages, config)
            tracked = await TrackedRequest.start(state, served, ROUTE, inputs, prime=False)
        except APIError as refused:
            code = "rate_limit_exceeded" if refused.status == 429 else "invalid_value"
            raise RealtimeError(refused.message, code=code, param=refused.param) from None
        try:
            yield _Reply(tracked)
        except APIError as failed:
            raise RealtimeError(failed.message, code="server_error", kind="server_error") from None
        finally:
            await tracked.close()

    return respond


def _hearer(served: ServedModel) -> Hear | None:
    """Starts the model's encoder over a turn's streamed 16 kHz speech; None for a model that
    hears nothing."""
    if not served.runtime.model.info.get("audio_input_rate"):
        return None

    @asynccontextmanager
    async def hear(audio: Any, request_id: str) -> AsyncIterator[Any]:
        async with served.runtime.generate(
            audio=audio, encode_only=True, request_id=request_id
        ) as outputs:
            yield outputs

    return hear


def _forgetter(served: ServedModel, session_id: str) -> Any:
    """Frees what the model kept of the session's conversation; None for a model that keeps
    nothing."""
    if "end_session" not in served.inputs:
        return None

    async def forget() -> None:
        try:
            async with served.runtime.generate(session=session_id, end_session=True) as out:
                async for _ in out:
                    pass
        except MstarError as exc:  # the runtime is closing: its pool goes with it
            log.warning("realtime.forget_failed", session=session_id, error=repr(exc))

    return forget


def _rewinder(served: ServedModel, session_id: str) -> Any:
    """Rolls what the model kept of the session's conversation back to where it changed; None
    for a model that keeps nothing."""
    if "rewind" not in served.inputs:
        return None

    async def rewind(messages: list[dict[str, Any]]) -> None:
        try:
            async with served.runtime.generate(
                messages=messages, session=session_id, rewind=True
            ) as out:
                async for _ in out:
                    pass
        except MstarError as exc:  # the next response rolls it back instead
            log.warning("realtime.rewind_failed", session=session_id, error=repr(exc))

    return rewind


def _warmer(served: ServedModel, session_id: str) -> Warm | None:
    """Prefills the session's spoken turn while it is spoken (``realtime/warm.py``); None for
    a model that cannot. A warm request is not counted against the model's in-flight bound
    (it must never refuse a response a place), and none starts while the model is at it."""
    if "warm" not in served.inputs or "session" not in served.inputs:
        return None

    async def warm(turn: WarmTurn | None, request_id: str) -> None:
        if turn is not None and served.admission.full:
            return
        inputs: dict[str, Any] = {"session": session_id, "warm": True}
        try:
            if turn is not None:
                inputs.update(_turn_inputs(served, session_id, turn.messages, turn.config))
            async with served.runtime.generate(request_id=request_id, **inputs) as out:
                async for _ in out:
                    pass
        except (MstarError, APIError) as exc:  # a warm is only ever worth some time
            log.warning("realtime.warm_failed", session=session_id, error=repr(exc))

    return warm


def _heard(state: ServerState, model: str) -> Any:
    def record(turn: HeardTurn) -> None:
        state.metrics.turn_audio.labels(model=model).observe(turn.samples / 16_000)
        state.metrics.turn_unheard.labels(model=model).observe(turn.unheard_s)

    return record


def _check_model(served: ServedModel) -> int:
    """The rate of the model's audio (0: it makes none).

    Raises:
        APIError: 400 when the model's program takes no chat messages.
    """
    if "messages" not in served.inputs:
        raise APIError(
            400,
            f"model {served.name!r} takes no chat messages, so it cannot hold a realtime "
            "conversation; serve qwen3-omni or a chat model",
            param="model",
        )
    return int(served.runtime.model.info.get("sample_rate") or 0)


async def realtime(ws: WebSocket) -> None:
    """Serve one realtime session (see the module docstring). Leaving closes every request."""
    protocols = ws.scope.get("subprotocols") or []
    await ws.accept(subprotocol="realtime" if "realtime" in protocols else None)
    state = server_state(ws)
    # A browser cannot set headers on a websocket: OpenAI's browser clients name the dialect
    # (and the key, which the guard reads) as subprotocols beside "realtime".
    beta = "realtime=v1" in ws.headers.get("openai-beta", "") or BETA_SUBPROTOCOL in protocols
    try:
        name = ws.query_params.get("model")
        if not name:
            raise APIError(400, "name the model: /v1/realtime?model=NAME", param="model")
        served = state.models.get_or_404(name)
        rate = _check_model(served)
    except APIError as refused:
        await ws.send_json(
            {"type": "error", "event_id": "event_0", "error": {**refused.body()["error"]}}
        )
        await ws.close(POLICY_VIOLATION)
        return
    lock = anyio.Lock()
    closed = False

    async def send(event: dict[str, Any] | None) -> None:
        nonlocal closed
        if event is None or closed:
            return
        try:
            async with lock:
                await ws.send_text(json.dumps(event))
        except (WebSocketDisconnect, RuntimeError, OSError):
            closed = True  # the client left; the session is being torn down

    voices = tuple(str(v).lower() for v in served.runtime.model.info.get("voices", ()))
    config = SessionConfig(modalities=("text", "audio") if rate else ("text",), voices=voices)
    session_id = new_id("sess")
    session = RealtimeSession(
        send,
        _responder(state, served, session_id),
        model=served.name,
        model_rate=rate or 24_000,
        vad=state.vad,
        beta=beta,
        config=config,
        hear=_hearer(served),
        on_heard=_heard(state, served.name),
        forget=_forgetter(served, session_id),
        rewind=_rewinder(served, session_id),
        warm=_warmer(served, session_id),
        session_id=session_id,
    )
    log.info("realtime.start", session=session.id, model=served.name, beta=beta)
    try:
        await session.run(_events(ws, send, session))
    finally:
        closed = True
        log.info("realtime.end", session=session.id)
    with suppress(RuntimeError, WebSocketDisconnect):  # the client closed first
        await ws.close()


async def _events(ws: WebSocket, send: Any, session: RealtimeSession) -> AsyncIterator[Any]:
    """The client's events, decoded; a frame that is not a JSON object is answered with an
    error event and skipped. Ends when the client disconnects."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        if not isinstance(text, str):
            refused = RealtimeError("send events as JSON text frames", param="type")
        elif len(text) > MAX_EVENT_BYTES:
            refused = RealtimeError(
                f"an event may be at most {MAX_EVENT_BYTES} bytes", code="event_too_large"
            )
        else:
            try:
                yield json.loads(text)
                continue
            except ValueError as exc:
                refused = RealtimeError(f"the event is not valid JSON: {exc}", code="invalid_json")
        await send(session.event("error", error=refused.body()))


def routes() -> list[BaseRoute]:
    """The realtime websocket route."""
    return [WebSocketRoute(ROUTE, realtime)]
