"""Model tests run on one event loop: they check what a model computes and streams, and the
runtime's behaviour on uvloop is checked by the runtime, conductor, worker and server tests
(the suite's time on two cores is the limit this keeps)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("asyncio", {})
