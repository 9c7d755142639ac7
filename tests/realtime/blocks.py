"""KV blocks of realtime requests, beyond what sessions' conversations keep between turns."""

from __future__ import annotations

import asyncio
from typing import Any


def request_blocks(runtime: Any) -> int:
    """Blocks in use minus what the engines keep of conversations (the thinker's and the
    talker's; a request's blocks shared with its conversation are the conversation's)."""
    batching = runtime.batching
    kept = sum(int(getattr(e, "kept_blocks", 0)) for e in batching.engines.values())
    return int(batching.kv_blocks_in_use) - kept


async def settled_request_blocks(runtime: Any) -> int:
    """``request_blocks`` once it reaches 0, or what it is after 10 s: a closed session ends
    on the server's loop a moment after the client's, so a leak still shows."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while request_blocks(runtime) and loop.time() < deadline:  # noqa: ASYNC110  (a count)
        await asyncio.sleep(0.01)
    return request_blocks(runtime)
