"""Transport: small-message latency, tensor throughput, and a streaming request per placement.

Three measurements in one run, all on this machine:

1. ``latency``: round trips of our ``Ping``/``Pong`` and of a decode-step-sized
   ``StepRequest``/``StepReply`` (three small tensors and a dataclass, answered by one small
   tensor; the small tensors travel inside the header, so each way is one frame, as the raw
   echo is) through our ``Link``/``Server``, over IPC and over TCP on loopback, against bare
   pyzmq DEALER/ROUTER echoing a 4-byte frame on the same transport (the floor). Both ends run
   in this process on one event loop (see ``mstar_async.transport._measure``). Figures are p50
   (and p90) over many round trips; the ratio ours/raw is taken within each repetition.
2. ``throughput``: one-way transfer of a float32 tensor of 1 MB and 64 MB (8 MB in quick
   mode) over IPC and TCP (send, receive, decode; best of a few; each end with its own ZeroMQ
   context and I/O thread, as two processes have), against plain memory copies
   on one thread: ``copy_`` into a buffer allocated once (the baseline; see below) and
   ``torch.clone`` (allocates, as a receive does). In-process the runtime hands a ``StepCall``
   over as a Python object: that is timed through an anyio memory stream (no bytes move, the
   receiver gets the very tensor), and reported as effectively free.
3. ``placements``: the ``demo`` model through ``open_runtime`` in-process (no placement), in
   one worker process (``Placement.single()``) and with the codec split off to a second worker
   (``Placement(nodes={"codec": 1})``): time to first audio (the first ``AudioChunk``) and
   total request time, p50 over a few requests after one warm-up request, plus each runtime's
   startup time. All three runtimes stay open together and take requests in turn (the order
   reversed every round), so their figures share the machine's state.

Why ``copy_`` is the baseline for tensors: it is the cost of moving the bytes once, with no
allocator in it. ``clone`` adds a fresh allocation whose pages fault in on first touch, which
on a large tensor can cost more than the copy itself; comparing against it would flatter the
transport. An IPC transfer copies the bytes twice (into the kernel and out again), which is
why the aim asks for half of one copy, not parity.

Result (a JSON-ready dict)::

    {
      "benchmark": "transport",
      "workload": {"mode": "quick" | "default", "repeat": int, "round_trips": int,
                   "tensor_sizes": [int, ...], "large_tensor_bytes": int,
                   "throughput_iterations": int, "requests_per_placement": int,
                   "max_codes": int, "denoise_steps": int, "loop": "asyncio" | "uvloop",
                   "notes": [str, ...]},
      "machine": machine_info() of benchmarks.common, plus "load_average_end",
      "header": {"request_encode_us": ..., ...},        # codec time, best of 5 runs
      "latency": [{"transport": "ipc" | "tcp", "message": "ping" | "step",
                   "ours_p50_us": S, "ours_p90_us": S, "raw_p50_us": S,
                   "ratio_ours_raw": S}, ...],
      "throughput": [{"size_bytes": int, "label": "64 MB",
                      "systems": {"copy": T, "clone": T, "ipc": T, "tcp": T, "inproc": T},
                      "ratios": {"ipc/copy": S, "ipc/clone": S, "tcp/copy": S}}, ...],
      "placements": [{"placement": "in-process" | "single" | "codec-split",
                      "spec": dict | None, "processes": int, "torch_threads": int,
                      "startup_s": float,
                      "requests": int, "ttfa_ms": S, "total_ms": S,
                      "ttfa_ms_samples": [...], "total_ms_samples": [...],
                      "audio_chunks": int, "audio_seconds": float}, ...],
      "aims": [{"aim": str, "measured": float, "target": float, "met": bool}, ...],
      "seconds_total": float,
    }

where ``S`` is a ``Summary.to_json()`` (median, min, max, n over the repetitions or requests)
and ``T`` is ``{"gb_per_s": S, "ms": S}`` plus ``"zero_copy_recv": bool`` for ipc and tcp
(the decoded tensor points into the received frame) and ``"copies": 0`` for inproc.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from benchmarks.common import ProgressLog, machine_info, quiet, ratio_table, summarize
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

__all__ = [
    "LATENCY_TARGET",
    "PLACEMENTS",
    "THROUGHPUT_TARGET",
    "TRANSPORTS",
    "format_transport",
    "run_transport",
    "run_transport_async",
]

Progress = Callable[[str], None]

#: The cross-process transports measured (IPC sockets and TCP on loopback).
TRANSPORTS = ("ipc", "tcp")

#: The placements of the end-to-end measurement, by the names the result uses.
PLACEMENTS = ("in-process", "single", "codec-split")

#: Aim: our small-message round trip at most this many times raw pyzmq's.
LATENCY_TARGET = 1.5

#: Aim: IPC tensor throughput at least this fraction of one plain memory copy (large tensor).
THROUGHPUT_TARGET = 0.5

_MB = 1 << 20

_MESSAGES = {"ping": "Ping/Pong", "step": "decode-step StepRequest/StepReply"}


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

    @property
    def large(self) -> int:
        return max(self.sizes)


def _workload(quick: bool, repeat: int) -> _Workload:
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if quick:
        return _Workload("quick", repeat, 300, (_MB, 8 * _MB), 3, 2, 24, 4, 1000)
    return _Workload("default", repeat, 2000, (_MB, 64 * _MB), 5, 5, 48, 8, 5000)


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
        zero_copy = {transport: True for transport in TRANSPORTS}
        for rep in range(work.repeat):
            measured: dict[str, dict[str, float]] = {}
            clone = measure_clone(nbytes, 2 * work.throughput_iterations)
            measured["copy"] = {"gb_per_s": clone["copy_gb_per_s"], "ms": clone["copy_ms"]}
            measured["clone"] = {"gb_per_s": clone["clone_gb_per_s"], "ms": clone["clone_ms"]}
            for transport in TRANSPORTS if rep % 2 == 0 else tuple(reversed(TRANSPORTS)):
                result = await measure_throughput(transport, nbytes, work.throughput_iterations)
                zero_copy[transport] &= bool(result["zero_copy_recv"])
                measured[transport] = {"gb_per_s": result["gb_per_s"], "ms": result["ms"]}
            measured["inproc"] = await _handover(nbytes, 100)
            rounds.append(measured)
            progress(
                f"throughput {_label(nbytes)} repetition {rep + 1}/{work.repeat}: "
                + ", ".join(
                    f"{name} {measured[name]['gb_per_s']:.2f} GB/s"
                    for name in ("copy", "clone", *TRANSPORTS)
                )
            )
        systems: dict[str, dict[str, Any]] = {}
        for name in ("copy", "clone", *TRANSPORTS, "inproc"):
            systems[name] = {
                key: summarize([r[name][key] for r in rounds]).to_json()
                for key in ("gb_per_s", "ms")
            }
        for transport in TRANSPORTS:
            systems[transport]["zero_copy_recv"] = zero_copy[transport]
        systems["inproc"]["copies"] = 0
        rates = [{name: r[name]["gb_per_s"] for name in r} for r in rounds]
        ratios = ratio_table(rates, [("ipc", "copy"), ("ipc", "clone"), ("tcp", "copy")])
        entries.append(
            {
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
    return Placement(nodes={"codec": 1})


@dataclass
class _Requests:
    """What one placement's timed requests measured."""

    ttfa: list[float]
    total: list[float]
    chunks: int = 0
    audio_seconds: float = 0.0


async def _one_request(runtime: Runtime, work: _Workload) -> tuple[float, float, int, float]:
    """Time to first audio, total time, chunks and seconds of audio of one demo request."""
    first: float | None = None
    chunks, seconds = 0, 0.0
    start = time.perf_counter()
    async with runtime.generate(
        text="Hello from the transport benchmark.",
        max_codes=work.max_codes,
        steps=work.denoise_steps,
    ) as outputs:
        async for item in outputs:
            if isinstance(item, AudioChunk):
                if first is None:
                    first = time.perf_counter() - start
                chunks += 1
                seconds += item.seconds
    total = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the demo request produced no audio")
    return first, total, chunks, seconds


async def _placements(work: _Workload, progress: Progress) -> list[dict[str, Any]]:
    startup: dict[str, float] = {}
    threads: dict[str, int] = {}
    runtimes: dict[str, Runtime] = {}
    measured = {name: _Requests([], []) for name in PLACEMENTS}
    async with contextlib.AsyncExitStack() as stack:
        for name in PLACEMENTS:
            model = build_model("demo")
            progress(f"placement {name}: opening the runtime")
            start = time.perf_counter()
            runtimes[name] = await stack.enter_async_context(
                open_runtime(model, placement=_placement(name))
            )
            startup[name] = time.perf_counter() - start
            pool = runtimes[name].pool
            # Torch threads per worker (in-process: this process's): on a small or busy
            # machine the thread count, not the transport, can dominate small forwards.
            threads[name] = torch.get_num_threads() if pool is None else pool.threads
            progress(f"placement {name}: open in {startup[name]:.2f} s; warm-up request")
            await _one_request(runtimes[name], work)
        for index in range(work.requests):
            # One request per placement per round, order reversed every round: the runtimes
            # take turns, so a change in the machine's load hits all of them alike.
            order = PLACEMENTS if index % 2 == 0 else tuple(reversed(PLACEMENTS))
            for name in order:
                ttfa, total, chunks, seconds = await _one_request(runtimes[name], work)
                entry = measured[name]
                entry.ttfa.append(ttfa * 1e3)
                entry.total.append(total * 1e3)
                entry.chunks, entry.audio_seconds = chunks, seconds
                progress(
                    f"placement {name} request {index + 1}/{work.requests}: first audio "
                    f"{ttfa * 1e3:.1f} ms, total {total * 1e3:.1f} ms"
                )
        progress("closing the runtimes")
    results: list[dict[str, Any]] = []
    for name in PLACEMENTS:
        placement = _placement(name)
        entry = measured[name]
        results.append(
            {
                "placement": name,
                "spec": None if placement is None else placement.to_dict(),
                # Worker processes; the in-process runtime has none besides this one.
                "processes": 0 if placement is None else placement.ranks,
                "torch_threads": threads[name],
                "startup_s": round(startup[name], 4),
                "requests": work.requests,
                "ttfa_ms": summarize(entry.ttfa).to_json(),
                "total_ms": summarize(entry.total).to_json(),
                "ttfa_ms_samples": [round(v, 3) for v in entry.ttfa],
                "total_ms_samples": [round(v, 3) for v in entry.total],
                "audio_chunks": entry.chunks,
                "audio_seconds": round(entry.audio_seconds, 4),
            }
        )
    return results


# --------------------------------------------------------------------------- aims and run


def _aims(
    latency: Sequence[dict[str, Any]], throughput: Sequence[dict[str, Any]], large: int
) -> list[dict[str, Any]]:
    aims: list[dict[str, Any]] = []
    for entry in latency:
        measured = entry["ratio_ours_raw"]["median"]
        aims.append(
            {
                "aim": (
                    f"{_MESSAGES[entry['message']]} round trip over {entry['transport']} "
                    f"<= {LATENCY_TARGET:g}x raw pyzmq (p50)"
                ),
                "measured": measured,
                "target": LATENCY_TARGET,
                "met": bool(measured <= LATENCY_TARGET),
            }
        )
    big = next(e for e in throughput if e["size_bytes"] == large)
    measured = big["ratios"]["ipc/copy"]["median"]
    aims.append(
        {
            "aim": (
                f"IPC throughput of a {_label(large)} tensor >= {THROUGHPUT_TARGET:g}x "
                "a plain memory copy (copy_)"
            ),
            "measured": measured,
            "target": THROUGHPUT_TARGET,
            "met": bool(measured >= THROUGHPUT_TARGET),
        }
    )
    return aims


def _loop_name() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    import asyncio

    return "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"


async def run_transport_async(
    *, quick: bool = False, repeat: int = 3, progress: Progress = quiet
) -> dict[str, Any]:
    """Run the transport benchmark on the running event loop; see the module doc for the
    result's shape. ``quick`` measures fewer round trips, 1 MB and 8 MB tensors (not 64 MB),
    and 2 requests per placement with shorter speech.

    Raises:
        ValueError: ``repeat`` < 1.
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    work = _workload(quick, repeat)
    started = time.perf_counter()
    machine = machine_info()
    progress(f"transport benchmark ({work.mode} mode): header codec")
    header = measure_header(work.header_iterations)
    latency = await _latency(work, progress)
    throughput = await _throughput(work, progress)
    placements = await _placements(work, progress)
    machine["load_average_end"] = machine_info()["load_average"]
    notes = [
        "latency: both ends in this process on one event loop; raw = bare zmq.asyncio "
        "DEALER/ROUTER echoing one 4-byte frame",
        "throughput: best of a few one-way transfers per repetition; copies on one thread",
        "inproc: a StepCall handed over through an anyio memory stream; the receiver gets "
        "the same tensor object (no bytes move), so its GB/s is only nominal",
    ]
    if quick:
        notes.append(
            f"quick mode: the large tensor is {_label(work.large)}, not 64 MB, so the "
            "throughput aim is measured at that size"
        )
    return {
        "benchmark": "transport",
        "workload": {
            "mode": work.mode,
            "repeat": work.repeat,
            "round_trips": work.round_trips,
            "tensor_sizes": list(work.sizes),
            "large_tensor_bytes": work.large,
            "throughput_iterations": work.throughput_iterations,
            "requests_per_placement": work.requests,
            "max_codes": work.max_codes,
            "denoise_steps": work.denoise_steps,
            "loop": _loop_name(),
            "notes": notes,
        },
        "machine": machine,
        "header": {key: round(value, 3) for key, value in header.items()},
        "latency": latency,
        "throughput": throughput,
        "placements": placements,
        "aims": _aims(latency, throughput, work.large),
        "seconds_total": round(time.perf_counter() - started, 1),
    }


def run_transport(
    *, quick: bool = False, repeat: int = 3, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the transport benchmark on a fresh event loop (uvloop when installed) and return
    its result (see the module doc). Progress goes to stderr unless ``progress`` is given.

    Raises:
        ValueError: ``repeat`` < 1.
        PlacementError, WorkerLost: a runtime with worker processes failed to start.
    """
    log: Progress = progress if progress is not None else ProgressLog()

    async def main() -> dict[str, Any]:
        return await run_transport_async(quick=quick, repeat=repeat, progress=log)

    try:
        import uvloop  # noqa: F401
    except ImportError:
        result: dict[str, Any] = anyio.run(main)
        return result
    result = anyio.run(main, backend_options={"use_uvloop": True})
    return result


# --------------------------------------------------------------------------- text report


def _cell(summary: dict[str, Any], digits: int = 1, suffix: str = "") -> str:
    median, low, high = summary["median"], summary["min"], summary["max"]
    if summary["n"] == 1:
        return f"{median:.{digits}f}{suffix}"
    return f"{median:.{digits}f}{suffix} [{low:.{digits}f}-{high:.{digits}f}]"


def format_transport(result: dict[str, Any]) -> str:
    """The result as text: latency, throughput and placement tables, then the aims."""
    work, machine = result["workload"], result["machine"]
    lines = [
        f"transport benchmark ({work['mode']} mode, {work['loop']} loop, "
        f"{work['repeat']} repetition(s))",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch "
        f"{machine['torch_version']}, load average {machine['load_average']} -> "
        f"{machine.get('load_average_end')}",
        "each cell: median [min-max] over repetitions (placements: over requests); ratios "
        "taken within each repetition",
        "",
        f"small-message round trip, p50 over {work['round_trips']} round trips (us)",
    ]
    header = (
        f"{'transport':>9} | {'message':>9} | {'ours p50':>22} | {'ours p90':>22} | "
        f"{'raw pyzmq p50':>22} | {'ours/raw':>20}"
    )
    lines += [header, "-" * len(header)]
    for e in result["latency"]:
        lines.append(
            f"{e['transport']:>9} | {e['message']:>9} | {_cell(e['ours_p50_us']):>22} | "
            f"{_cell(e['ours_p90_us']):>22} | {_cell(e['raw_p50_us']):>22} | "
            f"{_cell(e['ratio_ours_raw'], 2, 'x'):>20}"
        )
    h = result["header"]
    lines.append(
        f"header codec (decode-step request, {h['request_header_bytes']:.0f}-byte header, "
        f"{h['request_frames']:.0f} frames): encode {h['request_encode_us']:.1f} us, decode "
        f"{h['request_decode_us']:.1f} us; reply encode {h['reply_encode_us']:.1f} us, decode "
        f"{h['reply_decode_us']:.1f} us"
    )
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
        "ipc": "ipc",
        "tcp": "tcp",
    }
    for e in result["throughput"]:
        for name in ("copy", "clone", "ipc", "tcp", "inproc"):
            system = e["systems"][name]
            ratio = e["ratios"].get(f"{name}/copy")
            if name == "copy":
                versus = "1.00x"
            elif ratio is not None:
                versus = _cell(ratio, 2, "x")
            else:
                versus = "-"
            if name in ("ipc", "tcp"):
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
    lines += [
        "",
        f"demo request (max_codes={work['max_codes']}, {work['denoise_steps']} denoise steps), "
        f"p50 over {work['requests_per_placement']} requests after a warm-up",
    ]
    header = (
        f"{'placement':>12} | {'workers':>7} | {'threads':>7} | {'startup s':>9} | "
        f"{'first audio ms':>24} | {'total ms':>24} | {'audio':>14}"
    )
    lines += [header, "-" * len(header)]
    for e in result["placements"]:
        audio = f"{e['audio_chunks']} ch, {e['audio_seconds']:.2f} s"
        lines.append(
            f"{e['placement']:>12} | {e['processes']:>7} | {e['torch_threads']:>7} | "
            f"{e['startup_s']:>9.2f} | "
            f"{_cell(e['ttfa_ms']):>24} | {_cell(e['total_ms']):>24} | {audio:>14}"
        )
    lines += ["", "notes:", *(f"  {note}" for note in work["notes"]), "", "aims:"]
    for aim in result["aims"]:
        verdict = "met" if aim["met"] else "NOT met"
        lines.append(f"  {aim['aim']}: {aim['measured']:.2f}x: {verdict}")
    lines.append(f"\ntotal {result['seconds_total']} s")
    return "\n".join(lines)
