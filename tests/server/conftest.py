"""A live server over the tiny Llama, shared by the client tests of a module, per event loop."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI
from starlette.applications import Starlette

from mstar_async.models import build_model
from mstar_async.server import ModelSpec, ServedModel, create_app
from tests.server.live import live_server

#: The in-flight bound of the shared server: small, so overload is cheap to provoke.
LIMIT = 2


@dataclass
class Live:
    """A running server: its URL, its app (to look inside), and an OpenAI client for it."""

    url: str
    app: Starlette
    client: OpenAI

    def served(self, name: str = "causal-lm") -> ServedModel:
        served: ServedModel = self.app.state.server.models[name]
        return served


def openai_client(url: str) -> OpenAI:
    """A client that never retries (a retried 429 would hide the overload)."""
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def live(request: pytest.FixtureRequest, tiny_folder: Path) -> Iterator[Live]:
    model = build_model("causal-lm", path=tiny_folder, dtype="float32")
    app = create_app([ModelSpec(model)], max_concurrent=LIMIT)
    with live_server(app, loop=request.param) as url, openai_client(url) as client:
        yield Live(url, app, client)
