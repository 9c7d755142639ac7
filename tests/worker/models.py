"""Models that worker processes rebuild by import (``tests.worker.models:...``)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator
from typing import Any

import torch

from mstar_async.engines import StatelessEngine
from mstar_async.graph import DynamicLoop, Model, ModelSource, Node, Sequential, Walk, stream
from mstar_async.models import build_model
from mstar_async.policies import Chunk, FixedChunkPolicy

BOUND = 2


def _sink(items: list[Chunk]) -> dict[str, Any]:
    time.sleep(0.02)  # a slow consumer
    return {"seen": [c.data.clone() for c in items]}


async def _program(request: Any, n: int = 40) -> AsyncGenerator[Any, None]:
    async with request.stream("w", params={"n": n}, x=torch.tensor(0)) as events:
        async for event in events:
            yield int(event.value)


def build_slow_pipeline() -> Model:
    """A fast counter loop on one node streaming into a slow sink, one item per chunk."""
    nodes = [
        Node("count", engine="counter", inputs=["x"], outputs=["y"]),
        Node("sink", engine="sink", inputs=["items"], outputs=["seen"]),
    ]
    loop = DynamicLoop(
        "count",
        until=lambda s: int(s.outputs["count.y"]) >= s.params["n"],
        max_iterations=10_000,
        carry={"count.y": "count.x"},
    )
    model = Model(
        "slow-pipeline",
        nodes=nodes,
        edges=[stream("count.y", "sink.items", FixedChunkPolicy(1), max_buffer=BOUND)],
        walks=[Walk("w", Sequential(loop, "sink"), outputs=["sink.seen"])],
        program=_program,
        components={
            "counter": lambda: StatelessEngine({"count": lambda x: {"y": x + 1}}),
            "sink": lambda: StatelessEngine({"sink": _sink}),
        },
    )
    model.source = ModelSource("tests.worker.models:build_slow_pipeline")
    return model


def build_demo_needing_a_checkpoint() -> Model:
    """The demo model, as a model whose checkpoint is missing on hosts where the environment
    variable ``MSTAR_TEST_NO_CHECKPOINT`` is set: building it there fails."""
    if os.environ.get("MSTAR_TEST_NO_CHECKPOINT"):
        raise FileNotFoundError("no checkpoint folder /models/demo on this host")
    model = build_model("demo")
    model.source = ModelSource("tests.worker.models:build_demo_needing_a_checkpoint")
    return model
