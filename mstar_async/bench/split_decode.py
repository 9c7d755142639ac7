"""Prefill/decode split: decode pace after a prefill on another rank, and the KV move.

The causal-lm (SmolLM2-135M, its default form) runs one prompt of ``prompt_tokens`` tokens and
``decode_tokens`` greedy tokens per request (``ignore_eos``) under each layout, all open
together and taking requests in turn, the order reversed every round:

- ``co-located``: one worker runs both walks (``Placement.single()``): no KV moves;
- ``split-ipc``: ``examples/placements/prefill_decode.yaml`` (walk prefill on rank 0, walk
  decode on rank 1): each request's KV moves from rank 0 to rank 1 worker to worker as its
  decode walk starts, through shared memory (both workers on this host, IPC links);
- ``split-tcp`` (not in quick mode): the same, workers and their peer links over TCP on
  loopback (``LocalLauncher(endpoint_host="127.0.0.1")``): the KV goes as frames.

Per request: time to first token (the first ``TextDelta``), inter-token latency (from the first
to the last ``TextDelta``, per token after the first), and for a split, the KV move as rank 1
counted it (bytes, and the time from asking rank 0 until the state was there: the export on
rank 0, the transfer and the reply; then the import), and what passed through the conductor
(``WorkerPool.stats``: step messages, state bytes, bytes received, per request).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from mstar_async.bench.common import ratio_table, summarize
from mstar_async.models import build_model
from mstar_async.outputs import TextDelta
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.worker.launchers import LocalLauncher

__all__ = ["ITL_TARGET", "MOVE_TARGET_MB_S", "SPLITS", "SplitWorkload", "measure_split"]

Progress = Callable[[str], None]

#: Aim: decode inter-token latency after a prefill on another rank, at most this many times
#: the co-located one.
ITL_TARGET = 1.1

#: Aim: the KV move over shared memory at least this many MB/s.
MOVE_TARGET_MB_S = 1000.0

#: The layouts: co-located, then the splits (IPC, TCP).
SPLITS = ("co-located", "split-ipc", "split-tcp")

_SPLIT_YAML = (
    Path(__file__).resolve().parents[2] / "examples" / "placements" / "prefill_decode.yaml"
)
_WORDS = "the quick brown fox jumps over the lazy dog while a calm river runs to the sea "


@dataclass(frozen=True, slots=True)
class SplitWorkload:
    """Requests per layout (after one warm-up each), prompt and decode lengths, layouts."""

    requests: int
    prompt_tokens: int
    decode_tokens: int
    layouts: tuple[str, ...]


@dataclass
class _Measured:
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    move_mb: list[float] = field(default_factory=list)
    move_mb_s: list[float] = field(default_factory=list)
    fetch_ms: list[float] = field(default_factory=list)
    export_ms: list[float] = field(default_factory=list)
    import_ms: list[float] = field(default_factory=list)
    step_messages: int = 0
    state_bytes: int = 0
    conductor_bytes: list[float] = field(default_factory=list)


def _placement(layout: str) -> Placement:
    return Placement.single() if layout == "co-located" else Placement.from_yaml(_SPLIT_YAML)


@contextlib.asynccontextmanager
async def _open(layout: str) -> AsyncIterator[Runtime]:
    launcher = LocalLauncher(endpoint_host="127.0.0.1") if layout.endswith("-tcp") else None
    async with open_runtime(
        build_model("causal-lm"), placement=_placement(layout), launcher=launcher
    ) as runtime:
        yield runtime


@contextlib.asynccontextmanager
async def _open_all(
    layouts: tuple[str, ...], progress: Progress
) -> AsyncIterator[dict[str, Runtime]]:
    """Every layout's runtime, open together until the block exits."""
    opened: dict[str, Runtime] = {}
    release = anyio.Event()

    async def hold(
        layout: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        progress(f"split {layout}: opening the runtime")
        async with _open(layout) as runtime:
            opened[layout] = runtime
            task_status.started()
            await release.wait()

    try:
        async with anyio.create_task_group() as tg:
            for layout in layouts:
                await tg.start(hold, layout)
            try:
                yield opened
            finally:
                release.set()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def _prompt(runtime: Runtime, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens for the runtime's model."""
    text = ""
    limit = runtime.model.context
    while True:
        longer = text + _WORDS
        count = limit.count({"prompt": longer}) if limit is not None else len(longer) // 4
        if count > tokens:
            return text or longer
        text = longer


async def _one(runtime: Runtime, prompt: str, tokens: int) -> tuple[float, float]:
    """Time to first token and mean inter-token latency (seconds) of one request."""
    stamps: list[float] = []
    start = time.perf_counter()
    async with runtime.generate(prompt=prompt, max_tokens=tokens, ignore_eos=True) as outputs:
        async for item in outputs:
            if isinstance(item, TextDelta):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"the request streamed {len(stamps)} text deltas; need 2 or more")
    return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def _counters(runtime: Runtime) -> dict[str, int]:
    """The decode rank's counters, with the prefill rank's ``state_export_us``."""
    pool = runtime.pool
    assert pool is not None, "every layout runs on workers"
    decode = await pool.worker_stats(len(pool.ranks) - 1)
    prefill = await pool.worker_stats(0)
    return {**decode, "state_export_us": prefill["state_export_us"]}


async def _request(runtime: Runtime, prompt: str, work: SplitWorkload, into: _Measured) -> None:
    pool = runtime.pool
    assert pool is not None
    before, traffic = await _counters(runtime), pool.stats()
    ttft, itl = await _one(runtime, prompt, work.decode_tokens)
    after, now = await _counters(runtime), pool.stats()
    into.ttft_ms.append(ttft * 1e3)
    into.itl_ms.append(itl * 1e3)
    into.step_messages += now.step_messages - traffic.step_messages
    into.state_bytes += now.state_bytes - traffic.state_bytes
    into.conductor_bytes.append(now.bytes_received - traffic.bytes_received)
    moved = after["state_bytes_in"] - before["state_bytes_in"]
    if moved:
        fetch_us = after["state_fetch_us"] - before["state_fetch_us"]
        into.move_mb.append(moved / 1e6)
        into.move_mb_s.append(moved / max(fetch_us, 1))  # bytes per us = MB/s
        into.fetch_ms.append(fetch_us / 1e3)
        into.import_ms.append((after["state_import_us"] - before["state_import_us"]) / 1e3)
        into.export_ms.append((after["state_export_us"] - before["state_export_us"]) / 1e3)


async def measure_split(work: SplitWorkload, progress: Progress) -> list[dict[str, Any]]:
    """One ``split`` row per layout of ``work`` (see the module doc), plus an ``itl_ratio``
    (split / co-located, taken within each round) on each split row.

    Raises:
        PlacementError, WorkerLost: a runtime failed to start.
        RuntimeError: a request streamed fewer than two tokens.
    """
    measured = {layout: _Measured() for layout in work.layouts}
    async with _open_all(work.layouts, progress) as runtimes:
        prompt = _prompt(runtimes[work.layouts[0]], work.prompt_tokens)
        for layout in work.layouts:
            progress(f"split {layout}: warm-up request")
            await _one(runtimes[layout], prompt, work.decode_tokens)
        for index in range(work.requests):
            order = work.layouts if index % 2 == 0 else tuple(reversed(work.layouts))
            for layout in order:
                await _request(runtimes[layout], prompt, work, measured[layout])
                last = measured[layout]
                progress(
                    f"split {layout} request {index + 1}/{work.requests}: first token "
                    f"{last.ttft_ms[-1]:.1f} ms, inter-token {last.itl_ms[-1]:.2f} ms"
                )
    rounds = [
        {layout: measured[layout].itl_ms[i] for layout in work.layouts}
        for i in range(work.requests)
    ]
    return [_row(layout, work, measured[layout], rounds) for layout in work.layouts]


def _row(
    layout: str, work: SplitWorkload, m: _Measured, rounds: list[dict[str, float]]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "measurement": "split",
        "layout": layout,
        "spec": _placement(layout).to_dict(),
        "requests": work.requests,
        "prompt_tokens": work.prompt_tokens,
        "decode_tokens": work.decode_tokens,
        "ttft_ms": summarize(m.ttft_ms).to_json(),
        "itl_ms": summarize(m.itl_ms).to_json(),
        "itl_ms_samples": [round(v, 3) for v in m.itl_ms],
        "conductor": {
            "step_messages": m.step_messages,
            "state_bytes": m.state_bytes,
            "bytes_received_per_request": summarize(m.conductor_bytes).to_json(),
        },
    }
    if layout != "co-located":
        ratio = ratio_table(rounds, [(layout, "co-located")])[f"{layout}/co-located"]
        row["itl_ratio"] = ratio.to_json()
        row["move"] = {
            "mb": summarize(m.move_mb).to_json(),
            "mb_per_s": summarize(m.move_mb_s).to_json(),
            "fetch_ms": summarize(m.fetch_ms).to_json(),
            "export_ms": summarize(m.export_ms).to_json(),
            "import_ms": summarize(m.import_ms).to_json(),
        }
    return row
