"""Builders shared by the runtime tests: the tiny causal-lm, the speech-only demo, task checks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from anyio import wait_all_tasks_blocked

from mstar_async.graph import Model
from mstar_async.models import build_model

#: Demo inputs that keep a request short and speech only.
SPEECH = {"max_codes": 12, "image": False}


def tiny_lm(folder: Path) -> Model:
    """causal-lm over the tiny random Llama folder, in float32."""
    return build_model("causal-lm", path=str(folder), dtype="float32")


async def settled_tasks() -> set[asyncio.Task[Any]]:
    """Every task of the loop, once all of them are blocked."""
    await wait_all_tasks_blocked()
    return set(asyncio.all_tasks())


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch ops on one thread while the block lasts.

    Cancel-to-free time is the cancel path plus what is left of the forward in flight. On a
    small, oversubscribed machine (CI's 2 cores under a parallel test run) two OpenMP threads
    contending for the cores turn a ~1 ms tiny forward into 100+ ms of spinning, which would
    measure the machine's load rather than the runtime's cancel path.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
