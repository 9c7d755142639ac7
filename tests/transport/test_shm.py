"""Large tensors through shared memory: round trips, zero-copy receive, reuse, no leaks."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.transport import (
    SUPPORTED_DTYPES,
    FeedWalk,
    StateReply,
    TransportError,
    ZmqHub,
    decode_message,
    decode_value,
    encode_value,
    shm,
)
from mstar_async.transport.shm import SHM_TENSOR_BYTES, SegmentPool

from .support import COMPLEX_HALF_WARNING, PROPERTY, assert_same_tensor

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")

MB = 1 << 20


def ours() -> list[str]:
    """This process's segments in /dev/shm (other processes on the machine may make theirs)."""
    mine = f"{shm.PREFIX}{os.getpid()}-"
    return [name for name in shm.segment_names() if name.startswith(mine)]


def in_segment(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory lies in a mapping of an mstar segment (/proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and f"/{shm.PREFIX}" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


@pytest.fixture
def pool() -> Iterator[SegmentPool]:
    made = SegmentPool()
    yield made
    made.close()
    assert ours() == []


def round_trip(value: Any, pool: SegmentPool) -> tuple[Any, bytes, int]:
    header, buffers = encode_value(value, shm_batch=pool.batch())
    return decode_value(header, buffers), header, len(buffers)


# ---- codec ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@PROPERTY
@given(
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    delta=st.integers(-3, 3),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_across_the_threshold_is_bit_exact(
    dtype: torch.dtype, delta: int, transposed: bool, seed: int
) -> None:
    numel = SHM_TENSOR_BYTES // dtype.itemsize + delta
    tensor = random_tensor(dtype, numel, seed)
    if transposed:  # a non-contiguous tensor is made contiguous on the way
        tensor = tensor[: numel - numel % 2].reshape(2, -1).t()
    pool = SegmentPool()
    try:
        value, header, frames = round_trip({"t": tensor, "n": 1}, pool)
        assert value["n"] == 1
        assert_same_tensor(tensor, value["t"])
        through_shm = tensor.numel() * dtype.itemsize >= SHM_TENSOR_BYTES
        assert (frames, len(header) < 200) == ((0, True) if through_shm else (1, True))
        assert in_segment(value["t"]) is through_shm
        del value
    finally:
        pool.close()


def test_segments_are_reused_once_the_tensor_and_its_views_are_freed(pool: SegmentPool) -> None:
    tensor = random_tensor(torch.int32, SHM_TENSOR_BYTES // 4, 1)
    for _ in range(20):
        got, _, _ = round_trip(tensor, pool)
        assert torch.equal(got, tensor) and in_segment(got)
        del got
    assert pool.segments == 1  # each message found the previous one's segment free
    view = round_trip(tensor, pool)[0][10:20]
    gc.collect()
    # Only a view is left, but it still reads the segment: the next message needs another.
    other, _, _ = round_trip(tensor * 2, pool)
    assert pool.segments == 2
    assert torch.equal(view, tensor[10:20]) and torch.equal(other, tensor * 2)


def test_a_bigger_tensor_takes_a_bigger_segment_and_a_smaller_fits_one(pool: SegmentPool) -> None:
    big = random_tensor(torch.uint8, 3 * SHM_TENSOR_BYTES, 2)
    got, _, _ = round_trip(big, pool)
    assert torch.equal(got, big)
    del got
    smaller = big[: 3 * SHM_TENSOR_BYTES - 5]
    got, _, _ = round_trip(smaller, pool)
    assert torch.equal(got, smaller) and pool.segments == 1


def test_a_pool_keeps_two_free_segments_per_size(pool: SegmentPool) -> None:
    tensor = torch.ones(SHM_TENSOR_BYTES // 4)
    held = [round_trip(tensor, pool)[0] for _ in range(5)]
    assert pool.segments == len(ours()) == 5
    del held
    gc.collect()
    round_trip(tensor, pool)  # takes one free segment, keeps two, unlinks the other two
    assert pool.segments == len(ours()) == 3


def test_decoding_a_message_twice_is_refused(pool: SegmentPool) -> None:
    header, buffers = encode_value(torch.ones(SHM_TENSOR_BYTES // 4), shm_batch=pool.batch())
    first = decode_value(header, buffers)
    with pytest.raises(TransportError, match="decoded twice"):
        del first
        gc.collect()
        decode_value(header, buffers)


def test_a_message_read_after_its_pool_closed_is_a_clear_error() -> None:
    pool = SegmentPool()
    header, buffers = encode_value(torch.ones(SHM_TENSOR_BYTES // 4), shm_batch=pool.batch())
    pool.close()
    assert ours() == []
    with pytest.raises(TransportError, match="gone: its sender closed"):
        decode_value(header, buffers)


def test_a_failed_encoding_frees_its_segments(pool: SegmentPool) -> None:
    batch = pool.batch()
    with pytest.raises(TransportError, match="cannot send a value of type"):
        encode_value([torch.ones(SHM_TENSOR_BYTES // 4), object()], shm_batch=batch)
    batch.cancel()  # what a link does when encoding fails
    round_trip(torch.ones(SHM_TENSOR_BYTES // 4), pool)
    assert pool.segments == 1


def test_segments_of_dead_processes_are_swept(pool: SegmentPool) -> None:
    child = subprocess.run(["true"], check=True)
    assert child.returncode == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{dead.pid}-abcdef01-0")
    with open(orphan, "wb") as f:
        f.write(b"\0" * 64)
    round_trip(torch.ones(SHM_TENSOR_BYTES // 4), pool)  # a live segment of ours
    try:
        assert shm.sweep_orphans() >= 1
        assert not os.path.exists(orphan)
        assert len(ours()) == 1
    finally:
        if os.path.exists(orphan):
            os.unlink(orphan)


# ---- links ----------------------------------------------------------------------------------

anyio_mark = pytest.mark.anyio


@anyio_mark
async def test_many_messages_then_close_leave_no_segments() -> None:
    tensor = random_tensor(torch.int32, SHM_TENSOR_BYTES // 4 + 7, 3)
    with anyio.fail_after(30):
        with ZmqHub() as hub:
            server = hub.bind()
            link = hub.connect(server.endpoint, identity=b"w")
            assert link.shared_memory and server.shared_memory
            for i in range(30):
                await link.send(FeedWalk(i, "n.x", {"x": tensor}))
                identity, frames = await server.recv_frames()
                assert len(frames) == 1  # the header only: the tensor is in shared memory
                request = decode_message(frames)
                assert isinstance(request, FeedWalk)
                received = request.items["x"]
                assert torch.equal(received, tensor) and in_segment(received)
                await server.send(identity, StateReply(i, {"y": received}))  # echo it back
                reply = await link.recv()
                assert isinstance(reply, StateReply)
                assert torch.equal(reply.state["y"], tensor)
                del request, received, reply
            # One segment each way, reused by every message.
            assert len(ours()) == 2
        assert ours() == []


@anyio_mark
async def test_a_receiver_that_never_reads_leaves_no_segments() -> None:
    tensor = torch.ones(SHM_TENSOR_BYTES // 4)
    with anyio.fail_after(30):
        receiver, sender = ZmqHub(), ZmqHub()
        server = receiver.bind()
        link = sender.connect(server.endpoint)
        for i in range(8):
            await link.send(FeedWalk(i, "n.x", {"x": tensor}))
        await anyio.sleep(0.05)
        receiver.close()  # unread messages dropped with the socket
        assert len(ours()) == 8  # each still held for a message nobody read
        sender.close()
    assert ours() == []


@anyio_mark
async def test_a_failed_send_frees_its_segment() -> None:
    tensor = torch.ones(SHM_TENSOR_BYTES // 4)
    with anyio.fail_after(10), ZmqHub() as hub:
        server = hub.bind()
        link = hub.connect(server.endpoint, identity=b"w")
        await link.send(FeedWalk(0, "n.x", {"x": tensor}))
        _, held = await server.recv()  # keeps the request's segment busy
        with pytest.raises(TransportError, match="no peer"):
            await server.send(b"nobody", StateReply(0, {"y": tensor}))
        # The failed send's segment is free: the next one takes it instead of a new one.
        await server.send(b"w", StateReply(1, {"y": tensor}))
        reply = await link.recv()
        assert isinstance(reply, StateReply) and torch.equal(reply.state["y"], tensor)
        assert len(ours()) == 2  # the held request's, and one that both replies took
        del held


@anyio_mark
async def test_tcp_never_uses_shared_memory() -> None:
    tensor = torch.ones(2 * SHM_TENSOR_BYTES // 4)
    with anyio.fail_after(10), ZmqHub() as hub:
        server = hub.bind("tcp://127.0.0.1:0")
        link = hub.connect(server.endpoint)
        assert not link.shared_memory
        await link.send(FeedWalk(0, "n.x", {"x": tensor}))
        _, frames = await server.recv_frames()
        assert len(frames) == 2 and ours() == []
        with pytest.raises(TransportError, match="needs an ipc:// endpoint"):
            hub.connect(server.endpoint, shared_memory=True)
        off = hub.connect(hub.bind().endpoint, shared_memory=False)
        assert not off.shared_memory


_CHILD = textwrap.dedent(
    """
    import asyncio, sys, torch
    from mstar_async.transport import StateReply, FeedWalk, ZmqHub

    async def main():
        with ZmqHub() as hub:
            link = hub.connect(sys.argv[1], identity=b"child")
            gen = torch.Generator().manual_seed(7)
            x = torch.randn(int(sys.argv[2]), generator=gen)
            await link.send(FeedWalk(1, "n.x", {"x": x}))
            reply = await link.recv()  # stay up until the parent has read the tensor
            assert isinstance(reply, StateReply)

    asyncio.run(main())
    """
)


@anyio_mark
@pytest.mark.timeout(60)
async def test_a_tensor_from_another_process() -> None:
    numel = SHM_TENSOR_BYTES // 4 + 11
    with anyio.fail_after(50), ZmqHub() as hub:
        server = hub.bind()
        child = await anyio.open_process(
            [sys.executable, "-c", _CHILD, server.endpoint, str(numel)],
            cwd=os.getcwd(),
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        async with child:
            identity, frames = await server.recv_frames()
            request = decode_message(frames)
            assert isinstance(request, FeedWalk) and len(frames) == 1
            received = request.items["x"]
            expected = torch.randn(numel, generator=torch.Generator().manual_seed(7))
            assert torch.equal(received, expected) and in_segment(received)
            await server.send(identity, StateReply(1))
            assert await child.wait() == 0
        # The child's pool unlinked its segment when it exited; our mapping still reads.
        assert not any(n.startswith(f"{shm.PREFIX}{child.pid}-") for n in shm.segment_names())
        assert torch.equal(received, expected)
