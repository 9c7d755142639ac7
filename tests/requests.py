"""Running one request to the end from a test."""

from __future__ import annotations

from typing import Any

import anyio

from mstar_async.outputs import TextDelta


async def collect_text(runtime: Any, **inputs: Any) -> str:
    """Run a request and join the text it streamed; fails the test after two minutes."""
    with anyio.fail_after(120):
        async with runtime.generate(**inputs) as outputs:
            return "".join([o.text async for o in outputs if isinstance(o, TextDelta)])
