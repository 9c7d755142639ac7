"""Transport: small-message latency, tensor throughput, a streaming request per placement, and
decoding after a prefill on another rank.

Four measurements in one run, all on this machine:

1. ``latency``: round trips of our ``Ping``/``Pong`` and of a decode step's worth of walk
   traffic, a ``FeedWalk`` answered by a ``WalkUpdates`` (three small tensors and a dataclass,
   answered by one output, a small tensor; the small tensors travel inside the header, so
   each way is one frame, as the raw echo is) through our ``Link``/``Server``, over IPC and
   over TCP on loopback, against bare pyzmq DEALER/ROUTER echoing a 4-byte frame on the same
   transport (the floor). Both ends run in this process on one event loop (see
   ``mstar_async.transport._measure``). Figures are p50 (and p90) over many round trips; the
   ratio ours/raw is taken within each repetition.
2. ``throughput``: one-way transfer of a float32 tensor of 1 MB and 64 MB (8 MB in quick
   mode) over IPC and TCP (send, receive, decode; best of a few; each end with its own ZeroMQ
   context and I/O thread, as two processes have), against plain memory copies. ``ipc`` is
   what links over IPC do by default: tensors of at least ``SHM_TENSOR_BYTES`` (2 MiB) go
   through shared memory (one copy into a recycled segment, the receiver maps it), smaller
   ones as frames; ``ipc-frames`` is IPC with shared memory turned off (every tensor copied
   into the kernel's socket and out again), as every IPC transfer was before. Measured
   on one thread: ``copy_`` into a buffer allocated once (the baseline; see below) and
   ``torch.clone`` (allocates, as a receive does). In-process the runtime hands a ``StepCall``
   over as a Python object: that is timed through an anyio memory stream (no bytes move, the
   receiver gets the very tensor), and reported as effectively free.
3. ``placements``: a streaming speech request of the ``demo`` model (its ``speak`` walk: the
   GRU LM's ``DynamicLoop`` streams codes over a sliding-window edge into the codec, and the
   program yields each window's PCM as an ``AudioChunk``; then its short image walk) through
   ``open_runtime`` at each placement: in-process (no placement), one worker process
   (``Placement.single()``), the codec split off to a second worker (``codec: 1``), the codec
   on two replicas (``codec: [1, 2]``), and the codec split with both ranks joined over TCP on
   loopback by ``mstar worker`` processes (``RemoteLauncher``), as workers on other hosts
   would. Measured: time to first audio (the first ``AudioChunk``), time to the last audio
   chunk (the speech's end-to-end latency) and total request time, p50 over a few requests
   after one warm-up request, plus each runtime's startup time (in quick mode the runtimes
   open all at once, so their startups overlap and each is longer than alone). All runtimes
   stay open together and take requests in turn (the order reversed every round), so their
   figures share the machine's state.
4. ``split``: the causal-lm with prefill and decode on two workers (its KV moving worker to
   worker) against both walks on one worker: decode inter-token latency, the KV move's MB/s,
   and what passed through the conductor (see ``mstar_async.bench.split_decode``).

Why ``copy_`` is the baseline for tensors: it is the cost of moving the bytes once, with no
allocator in it. ``clone`` adds a fresh allocation whose pages fault in on first touch, which
on a large tensor can cost more than the copy itself; comparing against it would flatter the
transport. An IPC transfer through frames copies the bytes twice (into the kernel and out
again); through shared memory once, plus the receiver's page-table work to map the segment;
the aim asks for half of one copy, not parity.

The result is a report of the shape every benchmark has (``mstar_async.bench.report``)::

    {
      "benchmark": "transport",
      "workload": {"mode": "quick" | "default", "repeat": int, "round_trips": int,
                   "tensor_sizes": [int, ...], "large_tensor_bytes": int,
                   "throughput_iterations": int, "requests_per_placement": int,
                   "max_codes": int, "denoise_steps": int, "loop": "asyncio" | "uvloop",
                   "notes": [str, ...]},
      "machine": machine_info() of mstar_async.bench.common, plus "load_average_end",
      "systems": [{"name", "description", ...}, ...],   # every name the rows use
      "results": [
        {"measurement": "header", "request_encode_us": ..., ...},   # codec time, best of 5
        {"measurement": "latency", "transport": "ipc" | "tcp", "message": "ping" | "step",
         "ours_p50_us": S, "ours_p90_us": S, "raw_p50_us": S, "ratio_ours_raw": S}, ...,
        {"measurement": "throughput", "size_bytes": int, "label": "64 MB",
         "systems": {"copy": T, "clone": T, "ipc": T, "ipc-frames": T, "tcp": T, "inproc": T},
         "ratios": {"ipc/copy": S, "ipc/clone": S, "ipc-frames/copy": S, "tcp/copy": S}}, ...,
        {"measurement": "placement", "placement": one of PLACEMENTS, "spec": dict | None,
         "processes": int, "transport": "inproc" | "ipc" | "tcp",
         "launcher": "none" | "local" | "remote", "torch_threads": int,
         "startup_s": float, "requests": int,
         "ttfa_ms": S, "last_audio_ms": S, "total_ms": S,
         "ttfa_ms_samples": [...], "last_audio_ms_samples": [...], "total_ms_samples": [...],
         "audio_chunks": int, "audio_seconds": float}, ...,
        {"measurement": "split", "layout": one of SPLITS, "spec": dict, "requests": int,
         "prompt_tokens": int, "decode_tokens": int, "ttft_ms": S, "itl_ms": S,
         "itl_ms_samples": [...], "conductor": {"step_messages": int, "state_bytes": int,
         "bytes_received_per_request": S},
         # splits only:
         "itl_ratio": S, "move": {"mb": S, "mb_per_s": S, "fetch_ms": S, "export_ms": S,
                                 "import_ms": S}}, ...
      ],
      "aims": [{"name": str, "target": float, "measured": float, "met": bool,
                "compare": "<=" | ">="}, ...],
      "seconds": float,
    }

where ``S`` is a ``Summary.to_json()`` (median, min, max, n over the repetitions or requests)
and ``T`` is ``{"gb_per_s": S, "ms": S}`` plus ``"zero_copy_recv": bool`` for ipc, ipc-frames
and tcp (the decoded tensor points into the received frame or shared-memory segment),
``"shared_memory": bool`` for ipc (the tensor came through shared memory) and ``"copies": 0``
for inproc. ``rows(result, measurement)`` picks one kind of row. ``--throughput-only``
(``throughput_only=True``) has no latency, placement or split rows and runs only the
throughput aim; ``--split-only`` (``split_only=True``) has only the split rows and their aims.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import torch
from anyio.abc import TaskStatus

from mstar_async.bench.common import (
    ProgressLog,
    free_port,
    machine_info,
    quiet,
    ratio_table,
    summarize,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.bench.split_decode import (
    ITL_TARGET,
    MOVE_TARGET_MB_S,
    SPLITS,
    SplitWorkload,
    measure_split,
)
from mstar_async.loop import run_async
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.transport import StepCall
from mstar_async.transport._measure import (
    measure_clone,
    measure_header,
    measure_latency,
    measure_raw_latency,
    measure_throughput,
)
from mstar_async.transport.shm import SHM_TENSOR_BYTES
from mstar_async.worker.remote import RemoteLauncher

__all__ = [
    "LATENCY_TARGET",
    "PLACEMENTS",
    "THROUGHPUT_TARGET",
    "TRANSPORTS",
    "format_transport",
    "rows",
    "run_transport",
    "run_transport_async",
]

Progress = Callable[[str], None]

#: The cross-process transports measured (IPC sockets and TCP on loopback).
TRANSPORTS = ("ipc", "tcp")

#: The links tensors are timed over: IPC as links use it (large tensors through shared
#: memory), IPC with frames only, and TCP on loopback.
_TENSOR_LINKS = {"ipc": ("ipc", None), "ipc-frames": ("ipc", False), "tcp": ("tcp", None)}

#: The placements of the end-to-end measurement, by the names the result uses.
PLACEMENTS = ("in-process", "single", "codec-split", "replicas", "codec-split-tcp")

#: Aim: our small-message round trip at most this many times raw pyzmq's.
LATENCY_TARGET = 1.5

#: Aim: IPC tensor throughput at least this fraction of one plain memory copy (large tensor).
THROUGHPUT_TARGET = 0.5

_MB = 1 << 20

_MESSAGES = {"ping": "Ping/Pong", "step": "decode-step FeedWalk/WalkUpdates"}


@dataclass(frozen=True, slots=True)
class _Workload:
    mode: str
    repeat: int
    round_trips: int
    sizes: tuple[int, ...]
    throughput_iterations: int
    requests: int
    max_codes: int
    denoise_steps: int
    header_iterations: int
    split: SplitWorkload

    @property
    def large(self) -> int:
        return max(self.sizes)


def _workload(quick: bool, repeat: int) -> _Workload:
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if quick:
        split = SplitWorkload(2, 128, 16, SPLITS[:2])
        return _Workload("quick", repeat, 300, (_MB, 8 * _MB), 3, 2, 24, 4, 1000, split)
    split = SplitWorkload(5, 512, 64, SPLITS)
    return _Workload("default", repeat, 2000, (_MB, 64 * _MB), 5, 5, 48, 8, 5000, split)


def _label(nbytes: int) -> str:
    return f"{nbytes // _MB} MB"


# --------------------------------------------------------------------------- latency


async def _latency(work: _Workload, progress: Progress) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for transport in TRANSPORTS:
        rounds: list[dict[str, float]] = []
        for rep in range(work.repeat):
            # Alternate which side goes first, so a drift in the machine's load during a
            # repetition does not always favour the same one.
            if rep % 2 == 0:
                raw = await measure_raw_latency(transport, work.round_trips)
                ours = await measure_latency(transport, work.round_trips)
            else:
                ours = await measure_latency(transport, work.round_trips)
                raw = await measure_raw_latency(transport, work.round_trips)
            measured = {**raw, **ours}
            rounds.append(measured)
            progress(
                f"latency {transport} repetition {rep + 1}/{work.repeat}: raw "
                f"{measured['raw_p50_us']:.0f} us, ping {measured['ping_p50_us']:.0f} us, "
                f"step {measured['step_p50_us']:.0f} us (p50)"
            )
        ratios = ratio_table(rounds, [("ping_p50_us", "raw_p50_us"), ("step_p50_us", "raw_p50_us")])
        raw_p50 = summarize([r["raw_p50_us"] for r in rounds]).to_json()
        for message in _MESSAGES:
            entries.append(
                {
                    "measurement": "latency",
                    "transport": transport,
                    "message": message,
                    "ours_p50_us": summarize([r[f"{message}_p50_us"] for r in rounds]).to_json(),
                    "ours_p90_us": summarize([r[f"{message}_p90_us"] for r in rounds]).to_json(),
                    "raw_p50_us": raw_p50,
                    "ratio_ours_raw": ratios[f"{message}_p50_us/raw_p50_us"].to_json(),
                }
            )
    return entries


# --------------------------------------------------------------------------- throughput


async def _handover(nbytes: int, iterations: int) -> dict[str, float]:
    """In-process hand-over: a ``StepCall`` carrying the tensor goes through a memory stream,
    as steps travel between tasks of one process. Best time of ``iterations``."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    send, receive = anyio.create_memory_object_stream[StepCall](1)
    best = float("inf")
    async with send, receive:
        for _ in range(iterations):
            start = time.perf_counter()
            await send.send(StepCall("r", "e", "o", {"x": tensor}))
            received = await receive.receive()
            best = min(best, time.perf_counter() - start)
            # The same object arrives: nothing was serialised or copied.
            if received.inputs["x"] is not tensor:
                raise AssertionError("in-process hand-over copied the tensor")
    return {"gb_per_s": nbytes / best / 1e9, "ms": best * 1e3}


async def _throughput(work: _Workload, progress: Progress) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for nbytes in work.sizes:
        rounds: list[dict[str, dict[str, float]]] = []
        links = tuple(_TENSOR_LINKS)
        zero_copy = dict.fromkeys(links, True)
        via_shm = True
        for rep in range(work.repeat):
            measured: dict[str, dict[str, float]] = {}
            clone = measure_clone(nbytes, 2 * work.throughput_iterations)
            measured["copy"] = {"gb_per_s": clone["copy_gb_per_s"], "ms": clone["copy_ms"]}
            measured["clone"] = {"gb_per_s": clone["clone_gb_per_s"], "ms": clone["clone_ms"]}
            for name in links if rep % 2 == 0 else tuple(reversed(links)):
                transport, shared = _TENSOR_LINKS[name]
                result = await measure_throughput(
                    transport, nbytes, work.throughput_iterations, shared_memory=shared
                )
                zero_copy[name] &= bool(result["zero_copy_recv"])
                if name == "ipc":
                    via_shm &= bool(result["shared_memory"])
                measured[name] = {"gb_per_s": result["gb_per_s"], "ms": result["ms"]}
            measured["inproc"] = await _handover(nbytes, 100)
            rounds.append(measured)
            progress(
                f"throughput {_label(nbytes)} repetition {rep + 1}/{work.repeat}: "
                + ", ".join(
                    f"{name} {measured[name]['gb_per_s']:.2f} GB/s"
                    for name in ("copy", "clone", *links)
                )
            )
        systems: dict[str, dict[str, Any]] = {}
        for name in ("copy", "clone", *links, "inproc"):
            systems[name] = {
                key: summarize([r[name][key] for r in rounds]).to_json()
                for key in ("gb_per_s", "ms")
            }
        for name in links:
            systems[name]["zero_copy_recv"] = zero_copy[name]
        systems["ipc"]["shared_memory"] = via_shm
        systems["inproc"]["copies"] = 0
        rates = [{name: r[name]["gb_per_s"] for name in r} for r in rounds]
        ratios = ratio_table(
            rates, [("ipc", "copy"), ("ipc", "clone"), ("ipc-frames", "copy"), ("tcp", "copy")]
        )
        entries.append(
            {
                "measurement": "throughput",
                "size_bytes": nbytes,
                "label": _label(nbytes),
                "systems": systems,
                "ratios": {key: value.to_json() for key, value in ratios.items()},
            }
        )
    return entries


# --------------------------------------------------------------------------- placements


def _placement(name: str) -> Placement | None:
    if name == "in-process":
        return None
    if name == "single":
        return Placement.single()
    if name == "replicas":
        return Placement(nodes={"codec": [1, 2]})
    return Placement(nodes={"codec": 1})


def _transport(name: str) -> str:
    return "inproc" if name == "in-process" else "tcp" if name.endswith("-tcp") else "ipc"


def _launcher_kind(name: str) -> str:
    return "none" if name == "in-process" else "remote" if name.endswith("-tcp") else "local"


@contextlib.asynccontextmanager
async def _open(name: str) -> AsyncIterator[Runtime]:
    """The runtime of placement ``name``; for a ``-tcp`` one, its ranks are ``mstar worker``
    processes started here as a user would on other hosts, joined over loopback TCP."""
    placement = _placement(name)
    if _launcher_kind(name) != "remote":
        async with open_runtime(build_model("demo"), placement=placement) as runtime:
            yield runtime
        return
    assert placement is not None
    port = free_port()
    command = [sys.executable, "-m", "mstar_async.cli", "worker"]
    command += ["--conductor", f"tcp://127.0.0.1:{port}", "--rank"]
    procs = []
    try:
        for rank in range(placement.ranks):
            procs.append(
                await anyio.open_process(
                    [*command, str(rank)], stdout=None, stderr=subprocess.DEVNULL
                )
            )
        launcher = RemoteLauncher(f"tcp://127.0.0.1:{port}", data_port=0)
        async with open_runtime(
            build_model("demo"), placement=placement, launcher=launcher
        ) as runtime:
            yield runtime
        with anyio.move_on_after(10):
            for proc in procs:  # closing the runtime ends them
                await proc.wait()
    finally:
        with anyio.CancelScope(shield=True):
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()


@dataclass
class _Requests:
    """What one placement's timed requests measured."""

    ttfa: list[float]
    last_audio: list[float]
    total: list[float]
    chunks: int = 0
    audio_seconds: float = 0.0


async def _one_request(runtime: Runtime, work: _Workload) -> tuple[float, float, float, int, float]:
    """Time to first audio, to last audio, total time, chunks and seconds of audio of one
    demo request."""
    first: float | None = None
    last = 0.0
    chunks, seconds = 0, 0.0
    start = time.perf_counter()
    async with runtime.generate(
        text="Hello from the transport benchmark.",
        max_codes=work.max_codes,
        steps=work.denoise_steps,
    ) as outputs:
        async for item in outputs:
            if isinstance(item, AudioChunk):
                last = time.perf_counter() - start
                if first is None:
                    first = last
                chunks += 1
                seconds += item.seconds
    total = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the demo request produced no audio")
    return first, last, total, chunks, seconds


@contextlib.asynccontextmanager
async def _open_all(
    together: bool, progress: Progress
) -> AsyncIterator[dict[str, tuple[Runtime, float]]]:
    """Every placement's runtime and how long it took to open, open until the block exits.

    Each runtime lives in a task of its own, so that with ``together`` they all start at once
    (their worker processes' imports overlap) rather than one after another.
    """
    opened: dict[str, tuple[Runtime, float]] = {}
    all_open = anyio.Event()
    release = anyio.Event()

    async def hold(name: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        progress(f"placement {name}: opening the runtime")
        start = time.perf_counter()
        async with _open(name) as runtime:
            opened[name] = (runtime, time.perf_counter() - start)
            progress(f"placement {name}: open in {opened[name][1]:.2f} s")
            task_status.started()
            if len(opened) == len(PLACEMENTS):
                all_open.set()
            await release.wait()

    try:
        async with anyio.create_task_group() as tg:
            for name in PLACEMENTS:
                if together:
                    tg.start_soon(partial(hold, name))
                else:
                    await tg.start(partial(hold, name))
            await all_open.wait()
            try:
                yield opened
            finally:
                release.set()
    except BaseExceptionGroup as group:
        # One failure (a runtime that did not open, a request that failed) is what callers
        # catch, not the group the task group wraps it in.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _placements(work: _Workload, progress: Progress) -> list[dict[str, Any]]:
    startup: dict[str, float] = {}
    threads: dict[str, int] = {}
    runtimes: dict[str, Runtime] = {}
    measured = {name: _Requests([], [], []) for name in PLACEMENTS}
    async with _open_all(work.mode == "quick", progress) as opened:
        for name in PLACEMENTS:
            runtimes[name], startup[name] = opened[name]
            pool = runtimes[name].pool
            # Torch threads per worker (in-process: this process's): on a small or busy
            # machine the thread count, not the transport, can dominate small forwards.
            threads[name] = torch.get_num_threads() if pool is None else pool.threads
            progress(f"placement {name}: warm-up request")
            await _one_request(runtimes[name], work)
        for index in range(work.requests):
            # One request per placement per round, order reversed every round: the runtimes
            # take turns, so a change in the machine's load hits all of them alike.
            order = PLACEMENTS if index % 2 == 0 else tuple(reversed(PLACEMENTS))
            for name in order:
                ttfa, last, total, chunks, seconds = await _one_request(runtimes[name], work)
                entry = measured[name]
                entry.ttfa.append(ttfa * 1e3)
                entry.last_audio.append(last * 1e3)
                entry.total.append(total * 1e3)
                entry.chunks, entry.audio_seconds = chunks, seconds
                progress(
                    f"placement {name} request {index + 1}/{work.requests}: first audio "
                    f"{ttfa * 1e3:.1f} ms, last audio {last * 1e3:.1f} ms, total "
                    f"{total * 1e3:.1f} ms"
                )
        progress("closing the runtimes")
    results: list[dict[str, Any]] = []
    for name in PLACEMENTS:
        placement = _placement(name)
        entry = measured[name]
        results.append(
            {
                "measurement": "placement",
                "placement": name,
                "spec": None if placement is None else placement.to_dict(),
                # Worker processes; the in-process runtime has none besides this one.
                "processes": 0 if placement is None else placement.ranks,
                "transport": _transport(name),
                "launcher": _launcher_kind(name),
                "torch_threads": threads[name],
                "startup_s": round(startup[name], 4),
                "requests": work.requests,
                "ttfa_ms": summarize(entry.ttfa).to_json(),
                "last_audio_ms": summarize(entry.last_audio).to_json(),
                "total_ms": summarize(entry.total).to_json(),
                "ttfa_ms_samples": [round(v, 3) for v in entry.ttfa],
                "last_audio_ms_samples": [round(v, 3) for v in entry.last_audio],
                "total_ms_samples": [round(v, 3) for v in entry.total],
                "audio_chunks": entry.chunks,
                "audio_seconds": round(entry.audio_seconds, 4),
            }
        )
    return results


# --------------------------------------------------------------------------- aims and run


def _aims(
    latency: Sequence[dict[str, Any]],
    throughput: Sequence[dict[str, Any]],
    split: Sequence[dict[str, Any]],
    large: int,
) -> list[dict[str, Any]]:
    aims: list[dict[str, Any]] = []
    for entry in latency:
        name = (
            f"{_MESSAGES[entry['message']]} round trip over {entry['transport']} "
            f"<= {LATENCY_TARGET:g}x raw pyzmq (p50)"
        )
        measured = entry["ratio_ours_raw"]["median"]
        aims.append(aim_entry(name, LATENCY_TARGET, measured, compare="<="))
    big = next((e for e in throughput if e["size_bytes"] == large), None)
    if big is not None:
        name = (
            f"IPC throughput of a {_label(large)} tensor >= {THROUGHPUT_TARGET:g}x "
            "a plain memory copy (copy_)"
        )
        aims.append(aim_entry(name, THROUGHPUT_TARGET, big["ratios"]["ipc/copy"]["median"]))
    for entry in split:
        if "itl_ratio" not in entry:
            continue
        name = (
            f"decode inter-token latency, prefill on another rank ({entry['layout']}) <= "
            f"{ITL_TARGET:g}x co-located"
        )
        aims.append(aim_entry(name, ITL_TARGET, entry["itl_ratio"]["median"], compare="<="))
        if entry["layout"] == "split-ipc":
            name = f"KV move rank to rank over shared memory >= {MOVE_TARGET_MB_S:g} MB/s"
            measured = entry["move"]["mb_per_s"]["median"]
            aims.append(aim_entry(name, MOVE_TARGET_MB_S, measured, unit="MB/s"))
    return aims


def _systems(throughput_only: bool, split_only: bool) -> list[dict[str, Any]]:
    """What each name in the results stands for."""
    splits = [
        system_entry(
            "co-located", "the causal-lm, prefill and decode walks on one worker (single)"
        ),
        system_entry(
            "split-ipc",
            "the causal-lm, prefill on rank 0 and decode on rank 1 (prefill_decode.yaml), "
            "its KV moving worker to worker through shared memory",
        ),
        system_entry(
            "split-tcp",
            "split-ipc with the workers and their peer links over TCP on loopback",
        ),
    ]
    if split_only:
        return splits
    entries = [
        system_entry("copy", "copy_ into a buffer allocated once: the tensor baseline"),
        system_entry("clone", "torch.clone (allocates, as a receive does)"),
        system_entry(
            "ipc",
            "a tensor over an IPC link as links send it (shared memory from "
            f"{SHM_TENSOR_BYTES >> 20} MiB, frames below)",
        ),
        system_entry("ipc-frames", "a tensor over an IPC link, shared memory off"),
        system_entry("tcp", "a tensor over a TCP link on loopback"),
        system_entry("inproc", "a StepCall handed over through an anyio memory stream"),
    ]
    if throughput_only:
        return entries
    entries += [
        system_entry("ours", "our Link/Server: Ping/Pong and decode-step round trips"),
        system_entry("raw", "bare zmq.asyncio DEALER/ROUTER echoing one 4-byte frame"),
    ]
    for name in PLACEMENTS:
        placement = _placement(name)
        entries.append(
            system_entry(
                name,
                f"the demo model's streaming request through open_runtime, {name} placement",
                placement=None if placement is None else placement.to_dict(),
                transport=_transport(name),
                launcher=_launcher_kind(name),
            )
        )
    return entries + splits


def _loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    import asyncio

    return "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"


async def run_transport_async(
    *,
    quick: bool = False,
    repeat: int = 3,
    progress: Progress = quiet,
    throughput_only: bool = False,
    split_only: bool = False,
) -> dict[str, Any]:
    """Run the transport benchmark on the running event loop; see the module doc for the
    result's shape. ``quick`` measures fewer round trips, 1 MB and 8 MB tensors (not 64 MB),
    2 requests per placement with shorter speech, and the split with a shorter prompt and
    decode and over IPC only. ``throughput_only`` skips the latency, placement and split
    measurements; ``split_only`` runs only the split.

    Raises:
        ValueError: ``repeat`` < 1, or both ``throughput_only`` and ``split_only``.
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    work = _workload(quick, repeat)
    started = time.perf_counter()
    machine = machine_info()
    if throughput_only and split_only:
        raise ValueError("throughput_only and split_only exclude each other")
    progress(f"transport benchmark ({work.mode} mode): header codec")
    header = measure_header(work.header_iterations)
    latency = [] if throughput_only or split_only else await _latency(work, progress)
    throughput = [] if split_only else await _throughput(work, progress)
    placements = [] if throughput_only or split_only else await _placements(work, progress)
    split = [] if throughput_only else await measure_split(work.split, progress)
    machine["load_average_end"] = machine_info()["load_average"]
    notes = [
        "latency: both ends in this process on one event loop; raw = bare zmq.asyncio "
        "DEALER/ROUTER echoing one 4-byte frame",
        "throughput: best of a few one-way transfers per repetition; copies on one thread; "
        "ipc sends tensors of at least SHM_TENSOR_BYTES through shared memory, ipc-frames "
        "never does",
        "inproc: a StepCall handed over through an anyio memory stream; the receiver gets "
        "the same tensor object (no bytes move), so its GB/s is only nominal",
        "placements: codec-split-tcp is codec-split with both ranks run as `mstar worker` "
        "processes joined over loopback TCP (RemoteLauncher), as on other hosts; last audio "
        "is the end of the streamed speech, total adds the request's image walk",
        "split: causal-lm (SmolLM2-135M), greedy, ignore_eos; inter-token latency from the "
        "first to the last text delta; the KV move's MB/s is its bytes over the time from "
        "the decode rank asking until the state was there (the export on the prefill rank "
        "included); split/co-located ratios taken within each round",
    ]
    if throughput_only:
        notes.append("throughput only: no latency, placement or split measurements")
    if split_only:
        notes.append("split only: no latency, throughput or placement measurements")
    elif quick:
        notes.append(
            "quick mode: the placements' runtimes open concurrently, so startup_s overlaps"
        )
    if quick:
        notes.append(
            f"quick mode: the large tensor is {_label(work.large)}, not 64 MB, so the "
            "throughput aim is measured at that size"
        )
    header_row = {"measurement": "header", **{k: round(v, 3) for k, v in header.items()}}
    return make_report(
        "transport",
        workload={
            "mode": work.mode,
            "repeat": work.repeat,
            "round_trips": work.round_trips,
            "tensor_sizes": list(work.sizes),
            "large_tensor_bytes": work.large,
            "throughput_iterations": work.throughput_iterations,
            "requests_per_placement": work.requests,
            "max_codes": work.max_codes,
            "denoise_steps": work.denoise_steps,
            "split_requests": work.split.requests,
            "split_prompt_tokens": work.split.prompt_tokens,
            "split_decode_tokens": work.split.decode_tokens,
            "loop": _loop_name(),
            "notes": notes,
        },
        machine=machine,
        systems=_systems(throughput_only, split_only),
        results=[header_row, *latency, *throughput, *placements, *split],
        aims=_aims(latency, throughput, split, work.large),
        seconds=time.perf_counter() - started,
    )


def run_transport(
    *,
    quick: bool = False,
    repeat: int = 3,
    progress: Progress | None = None,
    throughput_only: bool = False,
    split_only: bool = False,
) -> dict[str, Any]:
    """Run the transport benchmark on a fresh event loop (uvloop when installed) and return
    its result (see the module doc). Progress goes to stderr unless ``progress`` is given;
    ``throughput_only`` skips the latency, placement and split measurements, ``split_only``
    runs only the split.

    Raises:
        ValueError: ``repeat`` < 1, or both ``throughput_only`` and ``split_only``.
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    log: Progress = progress if progress is not None else ProgressLog()
    run = partial(
        run_transport_async,
        quick=quick,
        repeat=repeat,
        progress=log,
        throughput_only=throughput_only,
        split_only=split_only,
    )
    result: dict[str, Any] = run_async(run)
    return result


# --------------------------------------------------------------------------- text report


def _cell(summary: dict[str, Any], digits: int = 1, suffix: str = "") -> str:
    median, low, high = summary["median"], summary["min"], summary["max"]
    if summary["n"] == 1:
        return f"{median:.{digits}f}{suffix}"
    return f"{median:.{digits}f}{suffix} [{low:.{digits}f}-{high:.{digits}f}]"


def rows(result: dict[str, Any], measurement: str) -> list[dict[str, Any]]:
    """The rows of ``result["results"]`` of one ``measurement`` (``header``, ``latency``,
    ``throughput``, ``placement`` or ``split``), in order."""
    return [row for row in result["results"] if row["measurement"] == measurement]


def format_transport(result: dict[str, Any]) -> str:
    """The result as text: latency, throughput and placement tables, then the aims."""
    work, machine = result["workload"], result["machine"]
    lines = [
        f"transport benchmark ({work['mode']} mode, {work['loop']} loop, "
        f"{work['repeat']} repetition(s))",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch "
        f"{machine['torch_version']}, load average {machine['load_average']} -> "
        f"{machine.get('load_average_end')}",
        "each cell: median [min-max] over repetitions (placements, split: over requests); "
        "ratios taken within each repetition (or round)",
    ]
    lines += _latency_lines(result)
    lines += _throughput_lines(result)
    lines += _placement_lines(result)
    lines += _split_lines(result)
    lines += ["", "notes:", *(f"  {note}" for note in work["notes"]), "", "aims:"]
    for entry in result["aims"]:
        verdict = "met" if entry["met"] else "NOT met"
        unit = f" {entry['unit']}" if "unit" in entry else "x"
        lines.append(f"  {entry['name']}: {entry['measured']:.2f}{unit}: {verdict}")
    lines.append(f"\ntotal {result['seconds']} s")
    return "\n".join(lines)


def _latency_lines(result: dict[str, Any]) -> list[str]:
    """The round-trip table and the header codec's times."""
    if not rows(result, "latency"):
        return []
    work = result["workload"]
    lines: list[str] = []
    lines += ["", f"small-message round trip, p50 over {work['round_trips']} round trips (us)"]
    header = (
        f"{'transport':>9} | {'message':>9} | {'ours p50':>22} | {'ours p90':>22} | "
        f"{'raw pyzmq p50':>22} | {'ours/raw':>20}"
    )
    lines += [header, "-" * len(header)]
    for e in rows(result, "latency"):
        lines.append(
            f"{e['transport']:>9} | {e['message']:>9} | {_cell(e['ours_p50_us']):>22} | "
            f"{_cell(e['ours_p90_us']):>22} | {_cell(e['raw_p50_us']):>22} | "
            f"{_cell(e['ratio_ours_raw'], 2, 'x'):>20}"
        )
    (h,) = rows(result, "header")
    lines.append(
        f"header codec (decode-step feed, {h['request_header_bytes']:.0f}-byte header, "
        f"{h['request_frames']:.0f} frames): encode {h['request_encode_us']:.1f} us, decode "
        f"{h['request_decode_us']:.1f} us; reply encode {h['reply_encode_us']:.1f} us, decode "
        f"{h['reply_decode_us']:.1f} us"
    )
    return lines


def _throughput_lines(result: dict[str, Any]) -> list[str]:
    """The tensor throughput table."""
    if not rows(result, "throughput"):
        return []
    lines: list[str] = []
    lines += ["", "tensor throughput, one way, float32 (GB/s; ms per transfer)"]
    header = (
        f"{'size':>6} | {'system':>28} | {'GB/s':>22} | {'ms':>22} | {'vs copy_':>20} | "
        f"{'zero-copy recv':>14}"
    )
    lines += [header, "-" * len(header)]
    describe = {
        "copy": "copy_ (baseline)",
        "clone": "torch.clone",
        "inproc": "in-process hand-over",
        "ipc": f"ipc (shm >= {SHM_TENSOR_BYTES >> 20} MiB)",
        "ipc-frames": "ipc, frames only",
        "tcp": "tcp",
    }
    for e in rows(result, "throughput"):
        for name in ("copy", "clone", "ipc", "ipc-frames", "tcp", "inproc"):
            system = e["systems"][name]
            ratio = e["ratios"].get(f"{name}/copy")
            if name == "copy":
                versus = "1.00x"
            elif ratio is not None:
                versus = _cell(ratio, 2, "x")
            else:
                versus = "-"
            if name in _TENSOR_LINKS:
                zero_copy = "yes" if system["zero_copy_recv"] else "no"
            else:
                zero_copy = "-"
            # A hand-over moves no bytes: its nominal GB/s means nothing, its time is the cost.
            rate = "free (same object)" if name == "inproc" else _cell(system["gb_per_s"], 2)
            ms = _cell(system["ms"], 4 if name == "inproc" else 2)
            lines.append(
                f"{e['label']:>6} | {describe[name]:>28} | {rate:>22} | {ms:>22} | "
                f"{versus:>20} | {zero_copy:>14}"
            )
        lines.append(f"{'':>6}   ipc / torch.clone: {_cell(e['ratios']['ipc/clone'], 2, 'x')}")
    return lines


def _placement_lines(result: dict[str, Any]) -> list[str]:
    """The demo request's table, one row per placement."""
    if not rows(result, "placement"):
        return []
    work = result["workload"]
    lines: list[str] = []
    lines += [
        "",
        f"demo request (max_codes={work['max_codes']}, {work['denoise_steps']} denoise steps), "
        f"p50 over {work['requests_per_placement']} requests after a warm-up",
    ]
    header = (
        f"{'placement':>15} | {'workers':>7} | {'via':>6} | {'threads':>7} | "
        f"{'startup s':>9} | {'first audio ms':>22} | {'last audio ms':>22} | "
        f"{'total ms':>22} | {'audio':>14}"
    )
    lines += [header, "-" * len(header)]
    for e in rows(result, "placement"):
        audio = f"{e['audio_chunks']} ch, {e['audio_seconds']:.2f} s"
        lines.append(
            f"{e['placement']:>15} | {e['processes']:>7} | {e['transport']:>6} | "
            f"{e['torch_threads']:>7} | {e['startup_s']:>9.2f} | {_cell(e['ttfa_ms']):>22} | "
            f"{_cell(e['last_audio_ms']):>22} | {_cell(e['total_ms']):>22} | {audio:>14}"
        )
    return lines


def _split_lines(result: dict[str, Any]) -> list[str]:
    split = rows(result, "split")
    if not split:
        return []
    work = result["workload"]
    lines = [
        "",
        f"prefill/decode split (causal-lm, {work['split_prompt_tokens']}-token prompt, "
        f"{work['split_decode_tokens']} tokens), over {work['split_requests']} requests "
        "after a warm-up",
    ]
    header = (
        f"{'layout':>10} | {'first token ms':>22} | {'inter-token ms':>22} | "
        f"{'vs co-located':>20} | {'KV MB':>8} | {'move MB/s':>22} | {'export ms':>16} | "
        f"{'import ms':>16} | "
        f"{'conductor: steps, state B, B/request':>36}"
    )
    lines += [header, "-" * len(header)]
    for e in split:
        move = e.get("move")
        ratio = _cell(e["itl_ratio"], 2, "x") if "itl_ratio" in e else "1.00x"
        conductor = e["conductor"]
        seen = (
            f"{conductor['step_messages']}, {conductor['state_bytes']}, "
            f"{conductor['bytes_received_per_request']['median']:.0f}"
        )
        lines.append(
            f"{e['layout']:>10} | {_cell(e['ttft_ms']):>22} | {_cell(e['itl_ms'], 2):>22} | "
            f"{ratio:>20} | {move['mb']['median'] if move else 0:>8.2f} | "
            f"{_cell(move['mb_per_s'], 0) if move else '-':>22} | "
            f"{_cell(move['export_ms'], 2) if move else '-':>16} | "
            f"{_cell(move['import_ms'], 2) if move else '-':>16} | {seen:>36}"
        )
    return lines
