"""OpenAI-compatible text routes: ``/v1/chat/completions`` and ``/v1/completions``.

They serve any model whose program takes ``messages`` (chat) or ``prompt`` (completions) and
yields ``TextDelta``s, closing with a ``TextEnd`` for the token counts (``causal-lm`` does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mstar_async.outputs import TextDelta
from mstar_async.server.chat_audio import SpokenReply, spoken_reply, stream_chunks, whole_message
from mstar_async.server.errors import APIError
from mstar_async.server.limits import SAME_NAMES, FieldNames
from mstar_async.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    decode,
)
from mstar_async.server.served import ServedModel
from mstar_async.server.sse import DONE, EventStreamResponse, sse_event, unless_disconnected
from mstar_async.server.state import server_state
from mstar_async.server.tracked import TrackedRequest

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"


@dataclass(frozen=True)
class ResponseShape:
    """How one route's responses look: chat messages or plain completion text."""

    chat: bool
    id: str
    model: str
    created: int

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False) -> Any:
        """One streamed chunk carrying ``text`` (and the role, ``first``) or ``finish``."""
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            return self.delta_chunk(delta, finish)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def delta_chunk(self, delta: dict[str, Any], finish: str | None = None) -> Any:
        """A chat chunk with ``delta`` as it is."""
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> Any:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage}

    def whole(
        self, text: str, finish: str, usage: dict[str, int], message: dict[str, Any] | None = None
    ) -> Any:
        """The whole reply; a chat reply's message is ``message`` when given."""
        if self.chat:
            message = message or {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: a conversation continued by a text model.

    Raises:
        APIError, msgspec.ValidationError: a bad body, unknown model or overload; the app
            answers them as OpenAI-shaped errors (400, 404, 429).
    """
    body = decode(await request.body(), ChatCompletionRequest)
    served = _served(request, body.model, needs="messages")
    inputs = _sampling_inputs(body, body.max_completion_tokens or body.max_tokens)
    inputs["messages"] = _messages(body.messages)
    reply, speech = spoken_reply(body, served)
    inputs.update(speech)
    shape = ResponseShape(True, f"chatcmpl-{uuid.uuid4().hex}", served.name, int(time.time()))
    renamed = {} if body.max_completion_tokens is None else {"max_tokens": "max_completion_tokens"}
    fields = FieldNames(renamed)
    return await _respond(request, served, CHAT_ROUTE, inputs, body, shape, reply, fields)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: a prompt continued as written.

    Raises:
        APIError, msgspec.ValidationError: a bad body, unknown model or overload; the app
            answers them as OpenAI-shaped errors (400, 404, 429).
    """
    body = decode(await request.body(), CompletionRequest)
    served = _served(request, body.model, needs="prompt")
    inputs = _sampling_inputs(body, body.max_tokens)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise APIError(400, f"one prompt per request is served, got {len(prompts)}", param="prompt")
    inputs["prompt"] = prompts[0]
    shape = ResponseShape(False, f"cmpl-{uuid.uuid4().hex}", served.name, int(time.time()))
    return await _respond(request, served, COMPLETIONS_ROUTE, inputs, body, shape)


def routes() -> list[Route]:
    """The OpenAI-compatible text routes."""
    return [
        Route(CHAT_ROUTE, chat_completions, methods=["POST"]),
        Route(COMPLETIONS_ROUTE, completions, methods=["POST"]),
    ]


def _served(request: Request, name: str, *, needs: str) -> ServedModel:
    served = server_state(request).models.get_or_404(name)
    request.state.model = served.name
    if needs not in served.inputs:
        raise APIError(
            400,
            f"model {name!r} takes no {needs!r} input (its inputs: {served.inputs}); "
            "use POST /generate for it",
            param="model",
        )
    return served


def _sampling_inputs(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    if body.n != 1:
        raise APIError(400, f"one choice per request is served (n=1), got n={body.n}", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None and any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    given: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": stop,
        "ignore_eos": body.ignore_eos or None,
    }
    return {name: value for name, value in given.items() if value is not None}


def _messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}]: only text content parts are served, "
                        f"got type {part.type!r}",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = "".join(part.text or "" for part in content)
        out.append({"role": message.role, "content": content or ""})
    return out


def _check_supported(served: ServedModel, inputs: dict[str, Any]) -> None:
    for name in inputs:
        if name not in served.inputs:
            raise APIError(400, f"model {served.name!r} does not take {name!r}", param=name)


async def _respond(
    request: Request,
    served: ServedModel,
    route: str,
    inputs: dict[str, Any],
    body: SamplingFields,
    shape: ResponseShape,
    reply: SpokenReply | None = None,
    fields: FieldNames = SAME_NAMES,
) -> Response:
    _check_supported(served, inputs)
    # A stream answers at once (its first chunk carries the role); errors then come as events.
    tracked = await TrackedRequest.start(
        server_state(request), served, route, inputs, prime=not body.stream, fields=fields
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        if reply is not None:
            return EventStreamResponse(stream_chunks(tracked, shape, reply, include_usage))
        return EventStreamResponse(_stream(tracked, shape, include_usage))
    message: dict[str, Any] | None = None
    try:
        if reply is not None:
            spoken = reply
            message = await unless_disconnected(
                request.receive, lambda: whole_message(tracked, spoken)
            )
            text = None if message is None else ""
        else:
            text = await unless_disconnected(request.receive, lambda: _collect(tracked))
    finally:
        await tracked.close()
    if text is None:  # the client is gone: nobody reads a response
        return Response(status_code=204)
    usage = tracked.usage()
    return JSONResponse(shape.whole(text, tracked.finish_reason(), usage, message))


async def _collect(tracked: TrackedRequest) -> str:
    return "".join([i.text async for i in tracked.outputs() if isinstance(i, TextDelta)])


async def _stream(
    tracked: TrackedRequest, shape: ResponseShape, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    try:
        if shape.chat:  # the role comes first, as OpenAI's streams do
            yield sse_event(shape.chunk("", None, first=True))
        async for item in tracked.outputs():
            if isinstance(item, TextDelta):
                yield sse_event(shape.chunk(item.text, None))
        yield sse_event(shape.chunk(None, tracked.finish_reason()))
        if include_usage:
            yield sse_event(shape.usage_chunk(tracked.usage()))
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await tracked.close()
    yield DONE
