"""Measure the transport: header codec time, small-message latency, tensor throughput.

Run ``python -m mstar_async.transport._measure [--loop uvloop] [--quick]``. Each function
returns plain numbers so that a benchmark command can reuse it; ``main`` prints a table. Both
ends of every link run in this process and on one event loop, so latencies include two event
loop hops per direction, as a conductor and a worker each pay one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from mstar_async.transport.wire import (
    FeedWalk,
    Ping,
    Pong,
    WalkUpdates,
    decode_message,
    encode_message,
)
from mstar_async.transport.zmq_link import Link, Server, ZmqHub

__all__ = [
    "decode_step_feed",
    "decode_step_output",
    "measure_clone",
    "measure_header",
    "measure_latency",
    "measure_raw_latency",
    "measure_throughput",
]


def decode_step_feed() -> FeedWalk:
    """A decode step's worth of inputs sent to a walk: a few small tensors and a small
    dataclass, as one item of a streamed walk input.

    The dataclass is a stand-in with the shape of ``SamplingParams`` (transport may not import
    the engines); it is registered here under a private name.
    """
    from dataclasses import dataclass

    from mstar_async.transport.codec import register_wire_type, registered_wire_types

    @dataclass(frozen=True, slots=True)
    class _Sampling:
        temperature: float = 0.8
        top_p: float = 0.95
        top_k: int = 50
        seed: int | None = 1234
        max_tokens: int = 256
        stop_token_ids: frozenset[int] = frozenset({2, 128001})

    name = "mstar_async.transport._measure.Sampling"
    cls = registered_wire_types().get(name)
    if cls is None:
        cls = register_wire_type(_Sampling, name=name)
    inputs = {
        "tokens": torch.arange(8, dtype=torch.int64),
        "positions": torch.arange(100, 108, dtype=torch.int64),
        "block_table": torch.arange(16, dtype=torch.int32).reshape(1, 16),
        "sampling": cls(),
    }
    return FeedWalk(17, "decode.inputs", inputs)


def decode_step_output() -> WalkUpdates:
    """What a walk sends back for one decode step: one output, a small tensor."""
    return WalkUpdates(events=[[17, "decode.token", torch.arange(8, dtype=torch.int64), 0]])


def _per_call_us(fn: Callable[[], object], iterations: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best * 1e6


def measure_header(iterations: int = 20_000) -> dict[str, float]:
    """Microseconds per call (best of 5 runs) to encode and decode :func:`decode_step_feed`
    and :func:`decode_step_output`, plus the header size in bytes."""
    request = decode_step_feed()
    frames = encode_message(request)
    reply = decode_step_output()
    reply_frames = encode_message(reply)
    return {
        "request_encode_us": _per_call_us(lambda: encode_message(request), iterations),
        "request_decode_us": _per_call_us(lambda: decode_message(frames), iterations),
        "reply_encode_us": _per_call_us(lambda: encode_message(reply), iterations),
        "reply_decode_us": _per_call_us(lambda: decode_message(reply_frames), iterations),
        "request_header_bytes": float(len(frames[0])),
        "request_frames": float(len(frames)),
    }


def _endpoint(hub: ZmqHub, transport: str) -> str | None:
    return None if transport == "ipc" else "tcp://127.0.0.1:0"


async def _timed(op: Callable[[], Awaitable[Any]], iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        await op()
        samples.append(time.perf_counter() - start)
    return samples


def _summary_us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(len(ordered) * 0.9)] * 1e6,
    }


async def measure_latency(transport: str, iterations: int = 2000) -> dict[str, float]:
    """Round trip Ping -> Pong through :class:`Link` / :class:`Server` (encode, send, receive,
    decode, both ways), and of :func:`decode_step_feed` answered by :func:`decode_step_output`."""
    with ZmqHub() as hub:
        server: Server = hub.bind(_endpoint(hub, transport))
        link: Link = hub.connect(server.endpoint, identity=b"bench")

        async def ping() -> None:
            await link.send(Ping(1))
            identity, _ = await server.recv()
            await server.send(identity, Pong(1))
            await link.recv()

        request = decode_step_feed()
        reply = decode_step_output()

        async def step() -> None:
            await link.send(request)
            identity, _ = await server.recv()
            await server.send(identity, reply)
            await link.recv()

        await _timed(ping, 100)  # connect and warm up
        out = {f"ping_{k}": v for k, v in _summary_us(await _timed(ping, iterations)).items()}
        out.update({f"step_{k}": v for k, v in _summary_us(await _timed(step, iterations)).items()})
        return out


async def measure_raw_latency(transport: str, iterations: int = 2000) -> dict[str, float]:
    """The floor: the same round trip with bare ``zmq.asyncio`` DEALER/ROUTER and bytes."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    names = ZmqHub()  # only for a private IPC folder, removed on close
    try:
        if transport == "ipc":
            router.bind(names.ipc_endpoint())
        else:
            router.bind("tcp://127.0.0.1:0")
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))

        async def echo() -> None:
            await dealer.send_multipart([b"ping"])
            identity, body = await router.recv_multipart()
            await router.send_multipart([identity, body])
            await dealer.recv_multipart()

        await _timed(echo, 100)
        return {f"raw_{k}": v for k, v in _summary_us(await _timed(echo, iterations)).items()}
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        names.close()


async def measure_throughput(
    transport: str, nbytes: int, iterations: int = 5, *, shared_memory: bool | None = None
) -> dict[str, float]:
    """One-way tensor transfer (send, receive, decode) of ``nbytes``: best GB/s, whether the
    decoded tensor points into the received frame or shared-memory segment (zero-copy
    receive), and whether it came through shared memory (the default over IPC for tensors
    of at least ``SHM_TENSOR_BYTES``; ``shared_memory=False`` sends frames).

    The two ends open their sockets in separate hubs, so each has its own ZeroMQ context and
    I/O thread, as a conductor and a worker in two processes do: with one shared I/O thread,
    the sender's and the receiver's kernel copies would run one after the other on it.
    """
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    with ZmqHub() as receiver, ZmqHub() as sender:
        server = receiver.bind(_endpoint(receiver, transport))
        link = sender.connect(server.endpoint, identity=b"bench", shared_memory=shared_memory)
        msg = FeedWalk(1, "n.x", {"x": tensor})
        zero_copy = True
        via_shm = False

        async def transfer() -> None:
            nonlocal zero_copy, via_shm
            await link.send(msg)
            _, frames = await server.recv_frames()
            received = decode_message(frames)
            assert isinstance(received, FeedWalk)
            out = received.items["x"]
            if len(frames) > 1:
                view = frames[1].buffer
                start = _address(view)
                zero_copy &= start <= out.data_ptr() < start + view.nbytes
            else:
                via_shm = True
                zero_copy &= _in_segment(out.data_ptr())

        await transfer()
        best = min(await _timed(transfer, iterations))
        return {
            "gb_per_s": nbytes / best / 1e9,
            "ms": best * 1e3,
            "zero_copy_recv": zero_copy,
            "shared_memory": via_shm,
        }


def _in_segment(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a shared-memory segment (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "/mstar-" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def measure_clone(nbytes: int, iterations: int = 10) -> dict[str, float]:
    """Plain memory copies of the same size on one thread: ``torch.clone`` (allocates, like a
    receive does) and ``copy_`` into a buffer allocated once. Best GB/s and ms of each.

    One thread, because on a small shared machine torch's parallel copy mostly waits for busy
    cores; the thread count is restored afterwards.
    """
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(tensor)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target.copy_(tensor)
        clone = min(_timed_sync(tensor.clone, iterations))
        copy = min(_timed_sync(lambda: target.copy_(tensor), iterations))
    finally:
        torch.set_num_threads(threads)
    return {
        "clone_gb_per_s": nbytes / clone / 1e9,
        "clone_ms": clone * 1e3,
        "copy_gb_per_s": nbytes / copy / 1e9,
        "copy_ms": copy * 1e3,
    }


def _timed_sync(op: Callable[[], object], iterations: int) -> list[float]:
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return samples


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


async def _report(quick: bool) -> None:
    n = 300 if quick else 2000
    header = measure_header(2000 if quick else 20_000)
    print("header (decode-step request: 3 small tensors + a dataclass; 1-tensor reply)")
    for key, value in header.items():
        print(f"  {key:24s} {value:10.2f}")
    for transport in ("ipc", "tcp"):
        raw = await measure_raw_latency(transport, n)
        ours = await measure_latency(transport, n)
        print(f"round trip over {transport} (us)")
        for key, value in {**raw, **ours}.items():
            print(f"  {key:24s} {value:10.1f}")
    for nbytes in (1 << 20, 64 << 20):
        clone = measure_clone(nbytes)
        print(
            f"{nbytes >> 20} MB: torch.clone {clone['clone_gb_per_s']:.2f} GB/s "
            f"({clone['clone_ms']:.2f} ms), copy_ {clone['copy_gb_per_s']:.2f} GB/s "
            f"({clone['copy_ms']:.2f} ms)"
        )
        for transport in ("ipc", "tcp"):
            result = await measure_throughput(transport, nbytes, 3 if quick else 10)
            print(
                f"  {transport}: {result['gb_per_s']:.2f} GB/s ({result['ms']:.2f} ms), "
                f"zero-copy receive: {bool(result['zero_copy_recv'])}"
            )


def main(argv: list[str] | None = None) -> None:
    """Print the measurements; ``--loop uvloop`` runs them on uvloop."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(f"loop: {args.loop}")
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(_report(args.quick))
    else:
        asyncio.run(_report(args.quick))


if __name__ == "__main__":
    main()
