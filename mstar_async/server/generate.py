"""``POST /generate``: the native streaming route, for every model and every output type.

The body names the model and passes its program's inputs, each checked against the program's
annotation (tensors as nested lists, images as base64 or data URLs: see ``program_inputs``);
the response streams each output as a typed JSON event (see ``encode``) as server-sent events,
or NDJSON lines with ``"format": "ndjson"``, and ends with ``{"type": "done"}``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mstar_async.server.encode import encode_output
from mstar_async.server.errors import APIError
from mstar_async.server.limits import FieldNames
from mstar_async.server.schemas import GenerateRequest, decode
from mstar_async.server.sse import EventStreamResponse, ndjson_line, sse_event
from mstar_async.server.state import server_state
from mstar_async.server.tracked import TrackedRequest

GENERATE_ROUTE = "/generate"
#: Program inputs travel under ``inputs`` in the body.
INPUTS = FieldNames(prefix="inputs.")


async def generate(request: Request) -> Response:
    """Run one request of any served model and stream its outputs.

    Raises:
        APIError, msgspec.ValidationError: a bad body (an input of the wrong type, past a
            limit), unknown model or overload; the app answers them as OpenAI-shaped errors
            (400, 404, 429).
    """
    body = decode(await request.body(), GenerateRequest)
    state = server_state(request)
    served = state.models.get_or_404(body.model)
    request.state.model = served.name
    unknown = sorted(set(body.inputs) - set(served.inputs))
    if unknown:
        raise APIError(
            400,
            f"model {served.name!r} takes no input {unknown[0]!r}; its inputs: {served.inputs}",
            param=f"inputs.{unknown[0]}",
        )
    inputs = served.program_inputs.convert(body.inputs, prefix=INPUTS.prefix)
    tracked = await TrackedRequest.start(state, served, GENERATE_ROUTE, inputs, fields=INPUTS)
    if body.format == "ndjson":
        return EventStreamResponse(_events(tracked, ndjson_line), media_type="application/x-ndjson")
    return EventStreamResponse(_events(tracked, sse_event))


def routes() -> list[Route]:
    """The native routes."""
    return [Route(GENERATE_ROUTE, generate, methods=["POST"])]


async def _events(
    tracked: TrackedRequest, frame: Callable[[Any], bytes]
) -> AsyncGenerator[bytes, None]:
    try:
        async for item in tracked.outputs():
            yield frame(encode_output(item))
        if tracked.end is not None:
            yield frame(encode_output(tracked.end))
        yield frame({"type": "done"})
    except APIError as exc:
        yield frame({"type": "error", **exc.body()})
    finally:
        await tracked.close()
