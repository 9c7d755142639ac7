"""Running a coroutine function on a fresh event loop: uvloop when installed, asyncio otherwise.

For programs that own the process (the ``mstar`` command, the benchmarks); a library caller
runs the runtime in its own loop instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

__all__ = ["run_async"]


def run_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on a new event loop (uvloop when installed) and return its result.

    Raises:
        Whatever ``fn`` raises.
    """
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return anyio.run(fn, *args)
    return anyio.run(fn, *args, backend_options={"use_uvloop": True})
