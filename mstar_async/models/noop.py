"""``noop``: one ``DynamicLoop`` over one node whose engine does no work, to time the runtime.

Every iteration of the ``loop`` walk is one step of the ``count`` node; its engine adds one to
a counter and returns at once (or, with ``forward_ms``, sleeps that long once per batched
forward, however many steps the forward holds, as a fixed-cost model would). What a request
costs beyond that is the runtime's own: the walk, the batching loop, the transport to a worker.
``mstar bench overhead`` measures it.

Each step's output, ``count.x``, is the tuple ``(n, pid, forward)``: the request's counter
after this step, the id of the process whose engine ran it, and the number of forwards that
engine had run when it ran this step (1 for the first). The counter is carried into the next
iteration; the stamp lets a client count the forwards of an engine in a worker process, which
it cannot ask the worker for. The ``loop`` walk stops after ``iterations`` steps, a request
input, and the program yields every step's output as it comes.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from mstar_async.engines import Step, StepResult
from mstar_async.graph import DynamicLoop, LoopStep, Model, Node, Walk
from mstar_async.models.registry import register

#: One step's output: the counter after the step, the engine's process id, its forward number.
Tick = tuple[int, int, int]

#: The walk input that starts a request's counter at 0.
START: Tick = (0, 0, 0)

#: The most iterations one request may ask for.
MAX_ITERATIONS = 1_000_000


class NoopEngine:
    """An engine that does no work: each step's output is its input's counter plus one.

    ``forward_ms`` > 0 makes every forward sleep that long (``time.sleep``, which releases the
    GIL) once, whatever its batch size. ``forwards`` counts the forwards run so far.

    Raises:
        ValueError: ``forward_ms`` is negative.
    """

    stateless_steps = True  # a step run ahead and dropped leaves nothing behind

    def __init__(self, forward_ms: float = 0.0) -> None:
        if not forward_ms >= 0:
            raise ValueError(f"forward_ms must be >= 0, got {forward_ms!r}")
        self.forward_s = forward_ms / 1e3
        self.forwards = 0
        self.pid = os.getpid()

    def cost(self, step: Step) -> int:
        """Every step finishes in one forward."""
        return 1

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        """One ``(n + 1, pid, forward)`` tick per step, after the fixed sleep if any."""
        self.forwards += 1
        if self.forward_s:
            time.sleep(self.forward_s)
        forward, pid = self.forwards, self.pid
        return [{"x": (step.inputs["x"][0] + 1, pid, forward)} for step in steps]

    def release(self, request_id: str) -> None:
        """Nothing to release: the engine keeps no per-request state."""


def _done(step: LoopStep) -> bool:
    return step.iteration + 1 >= int(step.params["iterations"])


async def _program(request: Any, iterations: int = 16) -> AsyncGenerator[Tick, None]:
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be in [1, {MAX_ITERATIONS}], got {iterations}")
    params = {"iterations": iterations}
    async with request.stream("loop", params=params, x=START) as events:
        async for event in events:
            yield event.value


@register("noop", "one DynamicLoop over an engine that does no work (control-plane benchmark)")
def build_noop(forward_ms: float = 0.0) -> Model:
    """Build the noop model; ``forward_ms`` is the engine's fixed sleep per forward.

    Raises:
        ValueError: ``forward_ms`` is negative.
    """
    if not forward_ms >= 0:
        raise ValueError(f"forward_ms must be >= 0, got {forward_ms!r}")
    loop = DynamicLoop(
        "count", until=_done, max_iterations=MAX_ITERATIONS, carry={"count.x": "count.x"}
    )
    return Model(
        "noop",
        nodes=[Node("count", engine="noop", op="count", inputs=["x"], outputs=["x"])],
        walks=[Walk("loop", loop, outputs=["count.x"])],
        program=_program,
        components={"noop": lambda: NoopEngine(forward_ms)},
        description="an engine that does no work, in a DynamicLoop: the runtime's own cost",
    )
