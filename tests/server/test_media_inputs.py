"""Images over HTTP arrive as base64 or a data: URL; a server path in a request is refused
without being read, and the answer does not tell whether the file exists."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, create_app
from mstar_async.server.encode import png
from mstar_async.server.media import NOT_IMAGE_DATA
from tests.server.live import Reply, http, live_server

pytestmark = pytest.mark.timeout(120)

#: Files opened anywhere in this process, by path (an audit hook: it cannot be removed, so it
#: only records).
OPENED: list[str] = []


def _record_opens(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and args and isinstance(args[0], str | Path):
        OPENED.append(str(args[0]))


sys.addaudithook(_record_opens)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    torch.set_num_threads(1)
    app = create_app([ModelSpec(build_model("bagel")), ModelSpec(build_model("pi05"))])
    with live_server(app) as base:
        yield base


def _picture(side: int) -> bytes:
    image = torch.zeros(3, side, side)
    image[0, : side // 2] = 1.0
    return png(image)


def _edit(url: str, image: Any) -> Reply:
    inputs = {"prompt": "make it blue", "image": image, "steps": 1}
    return http("POST", f"{url}/generate", {"model": "bagel", "inputs": inputs})


def _events(reply: Reply) -> list[dict[str, Any]]:
    chunks = [c for c in reply.body.decode().split("\n\n") if c]
    return [json.loads(c[len("data: ") :]) for c in chunks]


def test_a_server_path_is_refused_unread_and_reveals_nothing(url: str, tmp_path: Path) -> None:
    existing, missing = tmp_path / "photo.png", tmp_path / "nothing-here.png"
    existing.write_bytes(_picture(64))
    OPENED.clear()  # the test wrote it: only the server's opens count from here
    replies = [_edit(url, str(path)) for path in (existing, missing, f"file://{existing}")]
    assert [r.status for r in replies] == [400, 400, 400]
    errors = [r.json()["error"] for r in replies]
    assert errors[0] == errors[1] == errors[2]  # the same answer whether the file exists or not
    assert errors[0]["param"] == "inputs.image"
    assert errors[0]["message"] == f"inputs.image: {NOT_IMAGE_DATA}"
    assert not [p for p in OPENED if p.startswith(str(tmp_path))]


@pytest.mark.parametrize("form", ["base64", "data-url"])
def test_an_image_as_base64_or_a_data_url_is_decoded(url: str, form: str) -> None:
    data = base64.b64encode(_picture(32)).decode()  # resized to the model's 64x64
    reply = _edit(url, data if form == "base64" else f"data:image/png;base64,{data}")
    assert reply.status == 200, reply.body
    assert [e["type"] for e in _events(reply)] == ["image", "done"]


@pytest.mark.parametrize(
    "image",
    [5, [[0.5]], "", "data:image/png,not-base64", base64.b64encode(b"not an image").decode()],
)
def test_anything_but_image_data_is_a_400(url: str, image: Any) -> None:
    reply = _edit(url, image)
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "inputs.image"


def test_every_image_input_over_http_is_decoded_the_same_way(url: str) -> None:
    data = base64.b64encode(_picture(64)).decode()
    body = {"model": "pi05", "inputs": {"image": data, "steps": 1}}
    reply = http("POST", f"{url}/generate", body)
    assert reply.status == 200, reply.body
    assert [e["type"] for e in _events(reply)] == ["action", "done"]
    body["inputs"]["image"] = "/etc/hostname"
    assert http("POST", f"{url}/generate", body).json()["error"]["message"] == (
        f"inputs.image: {NOT_IMAGE_DATA}"
    )
