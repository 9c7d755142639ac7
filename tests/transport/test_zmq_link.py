"""ZeroMQ links: real round trips over IPC and TCP, zero-copy receive, cancel safety, cleanup."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import anyio
import pytest
import torch
import zmq

from mstar_async.transport import (
    SUPPORTED_DTYPES,
    FeedWalk,
    Hello,
    Ping,
    Pong,
    Server,
    StateReply,
    TransportError,
    ZmqHub,
    decode_message,
    encode_message,
)
from mstar_async.transport.shm import SHM_TENSOR_BYTES

from .support import COMPLEX_HALF_WARNING, address, assert_same_tensor, open_fds, path_exists

pytestmark = pytest.mark.anyio

MB = 1 << 20


@pytest.fixture
def hub() -> Iterator[ZmqHub]:
    with ZmqHub() as opened:
        yield opened
    assert opened.open_sockets == 0


def bind(hub: ZmqHub, transport: str) -> Server:
    return hub.bind(None if transport == "ipc" else "tcp://127.0.0.1:0")


def payload(nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(nbytes)
    return torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=gen)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("nbytes", [MB, 64 * MB], ids=["1MB", "64MB"])
async def test_tensor_round_trip(hub: ZmqHub, transport: str, nbytes: int) -> None:
    with anyio.fail_after(60):
        server = bind(hub, transport)
        link = hub.connect(server.endpoint, identity=b"rank-1")
        tensor = payload(nbytes).to(torch.bfloat16 if nbytes == MB else torch.int32)
        await link.send(FeedWalk(1, "n.x", {"x": tensor}))

        identity, frames = await server.recv_frames()
        assert identity == b"rank-1"
        request = decode_message(frames)
        assert isinstance(request, FeedWalk)
        received = request.items["x"]
        assert received.dtype == tensor.dtype and torch.equal(received, tensor)
        if transport == "ipc" and nbytes >= SHM_TENSOR_BYTES:
            # Through shared memory: the header alone travels, the tensor maps the segment.
            assert len(frames) == 1
        else:
            # Zero-copy receive: the tensor lies inside the frame libzmq filled.
            start = address(frames[1].buffer)
            assert start <= received.data_ptr() < start + len(frames[1])
        del frames, request

        # Echo it back: the received tensor goes out again without a copy of ours.
        await server.send(identity, StateReply(1, {"y": received}))
        reply = await link.recv()
        assert isinstance(reply, StateReply)
        assert torch.equal(reply.state["y"], tensor)


@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_small_tensors_of_every_dtype(hub: ZmqHub, transport: str) -> None:
    # Small frames land at odd offsets of libzmq's shared receive buffer: decode copies those
    # that are misaligned for their dtype; values must come out the same either way.
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for i, dtype in enumerate(SUPPORTED_DTYPES):
        high = 2 if dtype == torch.bool else 256
        raw = torch.randint(0, high, (3 + i, 2 * dtype.itemsize), generator=gen)
        inputs[str(dtype)] = raw.to(torch.uint8).view(dtype)
    with anyio.fail_after(20):
        server = bind(hub, transport)
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(FeedWalk(1, "n.x", inputs))
        _, request = await server.recv()
        assert isinstance(request, FeedWalk)
        assert list(request.items) == list(inputs)
        for key, tensor in inputs.items():
            assert_same_tensor(tensor, request.items[key])


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_many_peers_many_messages_in_order(hub: ZmqHub, transport: str) -> None:
    with anyio.fail_after(20):
        server = bind(hub, transport)
        links = [hub.connect(server.endpoint, identity=f"w{i}".encode()) for i in range(3)]
        for i, link in enumerate(links):
            await link.send(Hello(rank=i, pid=os.getpid(), endpoint=server.endpoint, engines=[]))
        seen = {}
        for _ in links:
            identity, hello = await server.recv()
            assert isinstance(hello, Hello)
            seen[identity] = hello.rank
        assert seen == {b"w0": 0, b"w1": 1, b"w2": 2}
        for n in range(50):
            for identity in seen:
                await server.send(identity, Ping(n))
        for link in links:
            got = [await link.recv() for _ in range(50)]
            assert got == [Ping(n) for n in range(50)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_send_nowait_keeps_order_with_awaited_sends_and_carries_large_tensors(
    hub: ZmqHub, transport: str
) -> None:
    with anyio.fail_after(20):
        server = bind(hub, transport)
        link = hub.connect(server.endpoint, identity=b"w")
        big = payload(SHM_TENSOR_BYTES * 2)  # through shared memory over IPC
        sent = []
        for n in range(40):
            message = Ping(n) if n % 5 else StateReply(n, {"x": big})
            sent.append(message)
            if n % 2:
                link.send_nowait(message)
            else:
                await link.send(message)
        for expected in sent:
            _, got = await server.recv()
            if isinstance(expected, Ping):
                assert got == expected
            else:
                assert isinstance(got, StateReply) and got.id == expected.id
                assert torch.equal(got.state["x"], big)
        link.close()
        with pytest.raises(TransportError, match="closed"):
            link.send_nowait(Ping())


async def test_tcp_port_zero_reports_the_bound_port(hub: ZmqHub) -> None:
    server = hub.bind("tcp://127.0.0.1:0")
    host, port = server.endpoint.rsplit(":", 1)
    assert host == "tcp://127.0.0.1" and int(port) > 0


async def test_runs_on_the_requested_loop(
    hub: ZmqHub, anyio_backend: tuple[str, dict[str, object]]
) -> None:
    loop = type(asyncio.get_running_loop())
    uses_uvloop = bool(anyio_backend[1].get("use_uvloop"))
    assert loop.__module__.startswith("uvloop") == uses_uvloop
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint)
        await link.send(Ping(1))
        identity, ping = await server.recv()
        await server.send(identity, Pong(1))
        assert (ping, await link.recv()) == (Ping(1), Pong(1))


async def test_recv_is_cancel_safe(hub: ZmqHub) -> None:
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(Ping(0))
        identity, _ = await server.recv()
        for _ in range(3):
            with anyio.move_on_after(0.01) as scope:
                await link.recv()  # nothing to receive: cancelled while waiting
            assert scope.cancelled_caught
        for n in range(3):
            await server.send(identity, Ping(n))
        assert [await link.recv() for _ in range(3)] == [Ping(0), Ping(1), Ping(2)]


async def test_a_message_arriving_as_its_reader_is_cancelled_is_not_lost(hub: ZmqHub) -> None:
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(Ping(0))
        await server.recv()
        reader = asyncio.ensure_future(link.recv())
        await asyncio.sleep(0.01)  # the reader now waits on the socket
        pending = link._pending
        assert pending is not None and not pending.done()
        # The message lands and the reader is cancelled before it resumes: the reader sees
        # the cancel, the message waits for the next one.
        pending.set_result([zmq.Frame(bytes(f)) for f in encode_message(Pong(5))])
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await link.recv() == Pong(5)


async def test_a_reader_cancelled_before_its_message_leaves_it_in_the_socket(
    hub: ZmqHub,
) -> None:
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(Ping(0))
        identity, _ = await server.recv()
        reader = asyncio.ensure_future(link.recv())
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await server.send(identity, Pong(6))
        assert await link.recv() == Pong(6)


async def test_one_reader_at_a_time(hub: ZmqHub) -> None:
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(Ping(0))
        identity, _ = await server.recv()
        async with anyio.create_task_group() as tg:
            got: list[object] = []

            async def read() -> None:
                got.append(await link.recv())

            tg.start_soon(read)
            await anyio.sleep(0.01)
            with pytest.raises(TransportError, match="one reader task"):
                await link.recv()
            await server.send(identity, Pong(1))
        assert got == [Pong(1)]


async def test_close_while_receiving_is_a_transport_error(hub: ZmqHub) -> None:
    with anyio.fail_after(10):
        link = hub.connect(hub.ipc_endpoint("nobody"))
        async with anyio.create_task_group() as tg:

            async def close_soon() -> None:
                await anyio.sleep(0.02)
                link.close()

            tg.start_soon(close_soon)
            with pytest.raises(TransportError, match="closed while receiving"):
                await link.recv()
        with pytest.raises(TransportError, match="closed"):
            await link.send(Ping())
        with pytest.raises(TransportError, match="closed"):
            await link.recv()


async def test_send_to_an_unknown_peer_is_a_transport_error(hub: ZmqHub) -> None:
    server = hub.bind()
    with pytest.raises(TransportError, match="no peer b'ghost'"):
        await server.send(b"ghost", Ping())


async def test_bad_endpoints_are_transport_errors(hub: ZmqHub) -> None:
    with pytest.raises(TransportError, match="cannot bind"):
        hub.bind("tcp://127.0.0.1:no-port")
    with pytest.raises(TransportError, match="cannot connect"):
        hub.connect("nonsense://x")
    with pytest.raises(TransportError, match="too long"):
        hub.ipc_endpoint("x" * 200)
    assert hub.open_sockets == 0


async def test_closing_the_hub_releases_sockets_fds_and_ipc_files() -> None:
    # pyzmq starts one process-wide thread (own context, fds) at the first zero-copy frame.
    zmq.Frame(bytearray(2 * zmq.COPY_THRESHOLD), copy=False)
    before = open_fds()
    with anyio.fail_after(20):
        hub = ZmqHub()
        ipc = hub.bind()
        tcp = hub.bind("tcp://127.0.0.1:0")
        links = [hub.connect(ipc.endpoint), hub.connect(tcp.endpoint)]
        for link, server in zip(links, [ipc, tcp], strict=True):
            await link.send(FeedWalk(1, "n.x", {"x": payload(MB)}))
            identity, msg = await server.recv()
            await server.send(
                identity, StateReply(1, msg.items if isinstance(msg, FeedWalk) else {})
            )
            assert isinstance(await link.recv(), StateReply)
        links[0].close()
        assert hub.open_sockets == 3
        ipc_path = ipc.endpoint.removeprefix("ipc://")
        assert path_exists(ipc_path)
        hub.close()
        hub.close()  # idempotent
    assert hub.open_sockets == 0
    assert all(s.closed for s in (ipc, tcp, *links))
    assert not path_exists(os.path.dirname(ipc_path))
    assert open_fds() == before
    with pytest.raises(TransportError, match="closed"):
        hub.bind()


async def test_raw_frames_for_benchmarks(hub: ZmqHub) -> None:
    with anyio.fail_after(10):
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"b")
        await link.send_frames([b"ping", b"x" * 10])
        identity, frames = await server.recv_frames()
        assert [f.bytes for f in frames] == [b"ping", b"x" * 10]
        await server.send_frames(identity, encode_message(Pong(3)))
        assert decode_message(await link.recv_frames()) == Pong(3)
