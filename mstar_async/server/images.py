"""``POST /v1/images/generations``: OpenAI's image route over an image model (``bagel``).

A model serves it when its ``info`` declares ``image_size`` and its program takes ``prompt``;
the answer is one PNG as ``data[0].b64_json``.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mstar_async.outputs import ImageOutput
from mstar_async.server.encode import png
from mstar_async.server.errors import APIError
from mstar_async.server.schemas import ImageRequest, decode
from mstar_async.server.served import ServedModel
from mstar_async.server.sse import unless_disconnected
from mstar_async.server.state import server_state
from mstar_async.server.tracked import TrackedRequest

IMAGES_ROUTE = "/v1/images/generations"


async def generate_image(request: Request) -> Response:
    """Draw ``prompt`` with an image model; answer the PNG base64-encoded.

    Raises:
        APIError, msgspec.ValidationError: a bad body (400 naming the field: ``n`` other than
            1, a ``size`` other than the model's, ``response_format: "url"``, an
            ``output_format`` other than png), an unknown model (404), a model that makes no
            images (400, ``param: "model"``), overload (429).
    """
    body = decode(await request.body(), ImageRequest)
    state = server_state(request)
    served = state.models.get_or_404(body.model)
    request.state.model = served.name
    size = _image_size(served)
    _check(body, size)
    inputs: dict[str, Any] = {"prompt": body.prompt}
    for name, value in (("steps", body.steps), ("seed", body.seed)):
        if value is not None:
            inputs[name] = value
    tracked = await TrackedRequest.start(state, served, IMAGES_ROUTE, inputs, prime=False)
    try:
        images = await unless_disconnected(request.receive, lambda: _collect(tracked))
    finally:
        await tracked.close()
    if images is None:  # the client is gone
        return Response(status_code=204)
    data = [{"b64_json": base64.b64encode(png(image)).decode("ascii")} for image in images]
    return JSONResponse(
        {
            "created": int(time.time()),
            "data": data,
            "output_format": "png",
            "size": f"{size}x{size}",
        }
    )


def routes() -> list[Route]:
    """The image route."""
    return [Route(IMAGES_ROUTE, generate_image, methods=["POST"])]


def _image_size(served: ServedModel) -> int:
    size = served.runtime.model.info.get("image_size")
    if size is None or "prompt" not in served.inputs:
        raise APIError(
            400,
            f"model {served.name!r} makes no images; serve an image model (bagel) and name it",
            param="model",
        )
    return int(size)


def _check(body: ImageRequest, size: int) -> None:
    if body.n != 1:
        raise APIError(400, f"one image per request is served (n=1), got n={body.n}", param="n")
    if body.size not in (None, "auto", f"{size}x{size}"):
        raise APIError(
            400,
            f"size {body.size!r} is not served: this model draws {size}x{size} images "
            f"(send size '{size}x{size}' or 'auto')",
            param="size",
        )
    if body.response_format not in (None, "b64_json"):
        raise APIError(
            400,
            f"response_format {body.response_format!r} is not supported: images are returned "
            "inline, use 'b64_json'",
            param="response_format",
        )
    if body.output_format not in (None, "png"):
        raise APIError(
            400,
            f"output_format {body.output_format!r} is not supported; supported: png",
            param="output_format",
        )


async def _collect(tracked: TrackedRequest) -> list[Any]:
    return [item.image async for item in tracked.outputs() if isinstance(item, ImageOutput)]
