"""Structured logs carry the request id of the request that emitted them."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from mstar_async.graph import Node, Walk
from mstar_async.logs import configure_logging, get_logger
from mstar_async.runtime import open_runtime
from tests.conductor.helpers import make_model, t

pytestmark = pytest.mark.anyio
program_log = get_logger("mstar_async.tests.program")


async def test_every_event_inside_a_request_carries_its_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        program_log.info("program.step", detail="inside")
        yield float((await request.run("w", x=t(1)))["y"])

    model = make_model([node], [Walk("w", "a")], program, {"inc": lambda x: {"y": x + 1}})
    configure_logging("DEBUG")
    logging.getLogger("mstar_async").propagate = True  # let caplog see the records
    try:
        with caplog.at_level(logging.DEBUG, logger="mstar_async"):
            async with open_runtime(model) as runtime:
                async with runtime.generate(request_id="req-42") as outputs:
                    assert [item async for item in outputs] == [2.0]
    finally:
        configure_logging("WARNING")
    inside = [
        r.getMessage()
        for r in caplog.records
        if "request.start" in r.getMessage()
        or "program.step" in r.getMessage()
        or "request.end" in r.getMessage()
    ]
    assert len(inside) == 3
    assert all("request_id='req-42'" in message for message in inside)
    assert "detail='inside'" in inside[1]
