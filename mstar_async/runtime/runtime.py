"""``open_runtime``: everything one model needs to serve, inside the host's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from mstar_async.conductor import Conductor, RequestStream
from mstar_async.conductor.conductor import unwrap
from mstar_async.graph import Model
from mstar_async.logs import get_logger
from mstar_async.worker import BatchingLoop

log = get_logger("mstar_async.runtime")


class Runtime:
    """A running model: its engines, the batching loop that drives them, and its conductor.

    Obtain one from ``open_runtime``; it lives as long as that ``async with`` block.
    """

    def __init__(self, model: Model, loop: BatchingLoop, conductor: Conductor) -> None:
        self.model = model
        self.batching = loop
        self.conductor = conductor

    def generate(self, *, request_id: str | None = None, **inputs: Any) -> RequestStream:
        """Start a request and return its outputs as an async iterator (close it, or use
        ``async with``). Many requests may run at once, from any task of the host loop.

        Raises:
            RequestError: the inputs do not fit the model's request program.
        """
        return self.conductor.generate(request_id=request_id, **inputs)


@asynccontextmanager
async def open_runtime(
    model: Model, *, max_batch_size: int = 256, max_batch_tokens: int = 512
) -> AsyncIterator[Runtime]:
    """Build ``model``'s engines in this process and serve it until the block exits.

    Runs in whatever event loop is already running (asyncio or uvloop); it never creates or
    replaces one. Leaving the block cancels requests still running and stops the batching loop.
    ``max_batch_size`` and ``max_batch_tokens`` bound one forward of an engine (see
    ``BatchingLoop``).

    Raises:
        Whatever a component factory raises while building its engine.
    """
    engines = {}
    for name, factory in model.components.items():
        engines[name] = await anyio.to_thread.run_sync(factory)
    batching = BatchingLoop(
        engines, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens
    )
    log.info("runtime.open", model=model.name, engines=sorted(engines))
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(batching.run)
            try:
                async with Conductor(model, batching) as conductor:
                    yield Runtime(model, batching, conductor)
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The caller's own exception, not a group our task groups wrapped around it.
        raise unwrap(group) from None
    log.info("runtime.close", model=model.name)
