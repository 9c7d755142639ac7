"""Models that worker processes rebuild by import (``tests.worker.models:...``)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Sequence
from types import MappingProxyType
from typing import Any

import torch

from mstar_async.engines import StatelessEngine, Step, StepResult
from mstar_async.graph import (
    DynamicLoop,
    Edge,
    Model,
    ModelSource,
    Node,
    Parallel,
    Sequential,
    Walk,
    stream,
)
from mstar_async.models import build_model
from mstar_async.policies import Chunk, FixedChunkPolicy

BOUND = 2


def build_demo_needing_a_checkpoint() -> Model:
    """The demo model, as a model whose checkpoint is missing on hosts where the environment
    variable ``MSTAR_TEST_NO_CHECKPOINT`` is set: building it there fails."""
    if os.environ.get("MSTAR_TEST_NO_CHECKPOINT"):
        raise FileNotFoundError("no checkpoint folder /models/demo on this host")
    model = build_model("demo")
    model.source = ModelSource("tests.worker.models:build_demo_needing_a_checkpoint")
    return model


HANDOFF_SIDE = 128  # make.h is HANDOFF_SIDE**2 float32 per request: 64 KiB, kept on its worker


def _make(x: torch.Tensor) -> dict[str, Any]:
    if bool((x < 0).any()):
        time.sleep(1.0)  # a slow step, still running when its request is cancelled
    grid = torch.arange(HANDOFF_SIDE * HANDOFF_SIDE, dtype=torch.float32)
    h = torch.sin(x.float().reshape(-1, 1) + grid * 1e-3)
    return {"h": h.reshape(-1, HANDOFF_SIDE, HANDOFF_SIDE)}


async def _handoff_program(
    request: Any, x: float = 1.0, raw: bool = False, loop: bool = False
) -> AsyncGenerator[Any, None]:
    if loop:
        yield (await request.run("loop", x=torch.tensor(x)))["s"]
        return
    if raw:
        yield (await request.run("raw", x=torch.tensor(x)))["h"]
        return
    result = await request.run("w", x=torch.tensor(x))
    yield result["s"]
    yield result["c"]


def build_handoff() -> Model:
    """``make`` produces a large tensor that ``use`` and ``check`` consume: placed apart, it
    goes from worker to worker. Walk ``raw`` hands it to the program instead."""
    nodes = [
        Node("make", engine="maker", inputs=["x"], outputs=["h"]),
        Node("use", engine="user", inputs=["h"], outputs=["s"]),
        Node("check", engine="checker", inputs=["h"], outputs=["c"]),
        Node("halve", engine="maker", op="halve", inputs=["h"], outputs=["h2"]),
        Node("use2", engine="user", op="use", inputs=["h"], outputs=["s"]),
    ]
    # Halve h until the predicate, which reads the large tensor itself, says it is small.
    halving = DynamicLoop(
        "halve",
        until=lambda s: float(s.outputs["halve.h2"].abs().max()) < 0.2,
        max_iterations=10,
        carry={"halve.h2": "halve.h"},
    )
    model = Model(
        "handoff",
        nodes=nodes,
        edges=[
            Edge("make.h", "use.h"),
            Edge("make.h", "check.h"),
            Edge("make.h", "halve.h"),
            Edge("halve.h2", "use2.h"),
        ],
        walks=[
            Walk("w", Sequential("make", Parallel("use", "check")), outputs=["use.s", "check.c"]),
            Walk("raw", Sequential("make"), outputs=["make.h"]),
            Walk("loop", Sequential("make", halving, "use2"), outputs=["use2.s"]),
        ],
        program=_handoff_program,
        components={
            "maker": lambda: StatelessEngine({"make": _make, "halve": lambda h: {"h2": h * 0.5}}),
            "user": lambda: StatelessEngine({"use": lambda h: {"s": h.sum(dim=(1, 2))}}),
            "checker": lambda: StatelessEngine({"check": lambda h: {"c": h.amax(dim=(1, 2))}}),
        },
    )
    model.source = ModelSource("tests.worker.models:build_handoff")
    return model


def _sums(frames: list[Chunk]) -> dict[str, Any]:
    return {"sum": [sum(chunk.new) for chunk in frames]}


async def _listen(request: Any, frames: Any) -> AsyncGenerator[Any, None]:
    async with request.stream("listen", frames=frames) as events:
        async for event in events:
            yield event.value


def build_listener() -> Model:
    """A walk whose input arrives as a stream: ``enc`` sums each chunk of 4 items."""
    node = Node("enc", engine="e", op="sum", inputs=["frames"], outputs=["sum"])
    model = Model(
        "listener",
        nodes=[node],
        walks=[Walk("listen", "enc", streams={"enc.frames": FixedChunkPolicy(4)}, max_buffer=1)],
        program=_listen,
        components={"e": lambda: StatelessEngine({"sum": _sums})},
    )
    model.source = ModelSource("tests.worker.models:build_listener")
    return model


CHUNK = 2  # items per chunk on build_two_ranks' streaming edge


def _head(x: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    return {"y": x * 10, "gain": g}


def _consume(items: list[Chunk], gain: torch.Tensor, delay: torch.Tensor) -> dict[str, Any]:
    if float(delay.max()) > 0:
        time.sleep(float(delay.max()))  # a slow consumer
    if bool((gain < 0).any()):
        raise ValueError("negative gain")
    return {"out": torch.stack([c.data.sum() * g for c, g in zip(items, gain, strict=True)])}


async def _two_ranks_program(
    request: Any, n: int = 10, g: float = 1.0, delay: float = 0.0, walk: str = "w"
) -> AsyncGenerator[Any, None]:
    if walk == "bounce":
        inputs: dict[str, Any] = {"x": torch.tensor(0)}
    else:
        inputs = {"x": torch.tensor(0), "g": torch.tensor(g), "delay": torch.tensor(delay)}
    async with request.stream(walk, params={"n": n}, **inputs) as events:
        async for event in events:
            yield event.port, float(event.value)


def build_two_ranks() -> Model:
    """Placed with ``TWO_RANKS``, walk ``w`` splits into segments: ``head`` and a counting
    loop on rank 0 stream items to ``sink`` on rank 1 (chunks of ``CHUNK``, bound ``BOUND``),
    ``head.gain`` crosses to ``sink`` and ``sink.out`` back to ``tail`` as plain edges, and
    ``tail`` runs after ``sink`` has finished. Walk ``bounce`` loops over ``bump`` and
    ``echo``: placed on two ranks its loop would span them, which placement refuses, so
    ``TWO_RANKS`` puts both on rank 1. ``g < 0`` fails ``sink``; ``delay`` slows it (seconds
    per forward)."""
    nodes = [
        Node("head", engine="head", inputs=["x", "g"], outputs=["y", "gain"]),
        Node("count", engine="counter", inputs=["x"], outputs=["y"]),
        Node(
            "sink", engine="sink", op="consume", inputs=["items", "gain", "delay"], outputs=["out"]
        ),
        Node("tail", engine="head", op="tail", inputs=["x"], outputs=["z"]),
        Node("bump", engine="counter", op="count", inputs=["x"], outputs=["y"]),
        Node("echo", engine="echo", inputs=["x"], outputs=["y"]),
    ]
    count = DynamicLoop(
        "count",
        until=lambda s: int(s.outputs["count.y"]) >= s.params["n"],
        max_iterations=10**7,
        carry={"count.y": "count.x"},
    )
    bounce = DynamicLoop(
        Sequential("bump", "echo"),
        until=lambda s: int(s.outputs["echo.y"]) >= s.params["n"],
        max_iterations=10_000,
        carry={"echo.y": "bump.x"},
    )
    model = Model(
        "two-ranks",
        nodes=nodes,
        edges=[
            Edge("head.y", "count.x"),
            Edge("head.gain", "sink.gain"),
            stream("count.y", "sink.items", FixedChunkPolicy(CHUNK), max_buffer=BOUND),
            Edge("sink.out", "tail.x"),
            Edge("bump.y", "echo.x"),
        ],
        walks=[
            Walk("w", Sequential("head", count, "sink", "tail"), outputs=["sink.out", "tail.z"]),
            Walk("bounce", bounce, outputs=["echo.y"]),
        ],
        program=_two_ranks_program,
        components={
            "head": lambda: StatelessEngine({"head": _head, "tail": lambda x: {"z": x + 1000}}),
            "counter": lambda: StatelessEngine({"count": lambda x: {"y": x + 1}}),
            "sink": lambda: StatelessEngine({"consume": _consume}),
            "echo": lambda: StatelessEngine({"echo": lambda x: {"y": x * 1}}),
        },
    )
    model.source = ModelSource("tests.worker.models:build_two_ranks")
    return model


class SlowMoves:
    """An engine whose state moves take ``seconds`` on one side (``slow``: ``"export"`` or
    ``"import"``), on the forward thread as real moves run; everything else is ``inner``'s."""

    def __init__(self, inner: Any, slow: str, seconds: float) -> None:
        self.inner = inner
        self.slow = slow
        self.seconds = seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def cost(self, step: Step) -> int:
        return int(self.inner.cost(step))

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        return list(self.inner.forward(steps))

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def export_state(self, request_id: str) -> Any:
        if self.slow == "export":
            time.sleep(self.seconds)
        return self.inner.export_state(request_id)

    def import_state(self, request_id: str, state: Any) -> None:
        if self.slow == "import":
            time.sleep(self.seconds)
        self.inner.import_state(request_id, state)


def build_slow_moving_lm(path: str, slow: str, seconds: float) -> Model:
    """The causal-lm over the checkpoint folder ``path`` (float32), whose engine's state moves
    take ``seconds`` on the ``slow`` side (see ``SlowMoves``): time to act during a move."""
    model = build_model("causal-lm", path=path, dtype="float32")
    inner = model.components["lm"]
    model.components = MappingProxyType({"lm": lambda: SlowMoves(inner(), slow, seconds)})
    model.source = ModelSource(
        "tests.worker.models:build_slow_moving_lm",
        {"path": path, "slow": slow, "seconds": seconds},
    )
    return model
