"""A parent process for orphan tests: opens a runtime with two worker ranks, prints the worker
pids as one JSON line, then waits to be interrupted or killed."""

from __future__ import annotations

import json
import sys

import anyio

from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime


async def main() -> None:
    placement = Placement(nodes={"codec": 1})
    async with open_runtime(build_model("demo"), placement=placement) as runtime:
        assert runtime.pool is not None
        print(json.dumps([runtime.pool.pid(0), runtime.pool.pid(1)]), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    try:
        anyio.run(main)
    except KeyboardInterrupt:
        sys.exit(130)
