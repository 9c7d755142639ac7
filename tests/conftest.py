"""Shared test setup: every async test runs on the default asyncio loop and on uvloop."""

from __future__ import annotations

import pytest

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]
