"""Images that arrive over the network: base64, or a ``data:`` URL, decoded in memory.

A request never names a file on the server. A string that is not image data is refused with
one message whatever it names, before anything else looks at it, and nothing here touches the
file system, so a client learns nothing about which server paths exist. (``mstar run`` and
Python callers still pass paths: they run as the user who owns the files.)
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

import torch

from mstar_async.server.errors import APIError

#: The one answer to a string that is not image data (a path, a URL, anything else).
NOT_IMAGE_DATA = "images arrive as base64 or a data: URL; server paths are not read"
#: Pixels an input image may have: a compressed image can unpack to far more memory than the
#: body limit lets in, so the size is read from its header before any pixel is decoded.
MAX_IMAGE_PIXELS = 4096 * 4096


def decode_image(value: Any, *, param: str) -> torch.Tensor:
    """The image in ``value`` (base64 of an image file, or a ``data:image/...;base64,`` URL)
    as a ``[3, height, width]`` float tensor in [0, 1]. Synchronous; never suspends.

    Raises:
        APIError: 400 naming ``param`` when ``value`` is not image data (``NOT_IMAGE_DATA``),
            the data is not an image Pillow reads, or it has more than ``MAX_IMAGE_PIXELS``
            pixels; 501 when Pillow is not installed on the server.
    """
    data = _image_bytes(value, param)
    try:
        from PIL import Image
    except ImportError:
        raise APIError(
            501, "decoding images needs Pillow on the server: pip install 'mstar-async[image]'"
        ) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise APIError(
                        400,
                        f"{param}: the image is {width}x{height}; at most {MAX_IMAGE_PIXELS} "
                        "pixels are served",
                        param=param,
                    )
                rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(
            400, f"{param}: the data is not an image (PNG, JPEG, ...) Pillow reads", param=param
        ) from None
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1).float() / 255


def _image_bytes(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise APIError(400, f"{param}: {NOT_IMAGE_DATA}", param=param)
    text = value.strip()
    if text.startswith("data:"):
        header, comma, text = text.partition(",")
        if not comma or not header.endswith(";base64"):
            raise APIError(
                400,
                f"{param}: a data: URL of an image is base64, as data:image/png;base64,...",
                param=param,
            )
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: {NOT_IMAGE_DATA}", param=param) from None
    if not data:
        raise APIError(400, f"{param}: the image data is empty", param=param)
    return data
