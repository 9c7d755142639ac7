"""Shared helpers for the transport tests: wire-type registration, value strategies, comparison."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import torch
from anyio.abc import SocketAttribute, SocketStream
from hypothesis import settings
from hypothesis import strategies as st

from mstar_async.engines.sampling import SamplingParams
from mstar_async.policies import Chunk
from mstar_async.transport import SUPPORTED_DTYPES
from mstar_async.worker.wire_types import register_wire_types

# No example database: the tests must not write outside their own folders. Few examples: the
# machine is shared with benchmarks.
PROPERTY = settings(max_examples=80, deadline=None, database=None)

# complex32 works but torch warns that it is experimental whenever one is made.
COMPLEX_HALF_WARNING = "ignore:ComplexHalf support is experimental:UserWarning"


def register_test_wire_types() -> None:
    """Register Chunk and SamplingParams exactly as production code does (idempotent)."""
    register_wire_types()


def address(buffer: Any) -> int:
    """The address of the first byte of a (non-empty) buffer."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def open_fds() -> int:
    """How many file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


async def relay(source: SocketStream, sink: SocketStream, seen: bytearray) -> None:
    async for chunk in source:
        seen += chunk
        await sink.send(chunk)


@asynccontextmanager
async def tapped(port: int) -> AsyncIterator[tuple[int, bytearray]]:
    """A TCP relay on loopback to ``port`` that keeps every byte it forwards: its own port and
    the bytes."""
    seen = bytearray()

    async def forward(client: SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", port) as upstream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(relay, client, upstream, seen)
                await relay(upstream, client, seen)
                tg.cancel_scope.cancel()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, forward)
        yield listener.extra(SocketAttribute.local_port), seen
        tg.cancel_scope.cancel()


def path_exists(path: str) -> bool:
    """``os.path.exists``, here so async tests can call it (a local stat, never slow)."""
    return os.path.exists(path)


# ---- strategies -----------------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> torch.Tensor:
    """Tensors of any supported dtype with random bits; 0-dim, empty and non-contiguous too."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and len(shape) < 2:
        layout = "contiguous"
    if layout == "strided" and not shape:
        layout = "contiguous"
    made = list(shape)
    if layout == "transposed":
        made[-1], made[-2] = made[-2], made[-1]
    elif layout == "strided":
        made[0] *= 2
    numel = math.prod(made)
    if numel == 0:
        base = torch.empty(made, dtype=dtype)
    else:
        size = numel * dtype.itemsize
        if dtype == torch.bool:
            raw = bytes(draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
        else:
            raw = draw(st.binary(min_size=size, max_size=size))
        base = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(made)
    if layout == "transposed":
        out = base.transpose(-1, -2)
    elif layout == "strided":
        out = base[::2]
    else:
        out = base
    assert list(out.shape) == shape
    return out


def _chunks(data: st.SearchStrategy[Any]) -> st.SearchStrategy[Chunk]:
    @st.composite
    def build(draw: st.DrawFn) -> Chunk:
        items = draw(data)
        context = draw(st.integers(0, len(items)))
        lookahead = draw(st.integers(0, len(items) - context))
        start = draw(st.integers(0, 1000))
        return Chunk(items, start, context, lookahead, final=draw(st.booleans()))

    return build()


chunk_values = _chunks(
    st.one_of(
        st.lists(st.integers(0, 2**31), max_size=5),
        tensors().filter(lambda t: t.dim() >= 1),
    )
)

sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 4),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**64 - 1),
    max_tokens=st.integers(1, 4096),
    stop_token_ids=st.frozensets(st.integers(0, 2**20), max_size=4),
)

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    tensors(),
    chunk_values,
    sampling_params,
)
hashables = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=4))

values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.sets(hashables, max_size=4),
    ),
    max_leaves=12,
)


# ---- comparison -----------------------------------------------------------------------------


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits (bitwise, so NaN payloads count and NaN equals itself)."""
    assert type(b) is torch.Tensor
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert b.is_contiguous()
    if a.numel():
        try:
            dense = torch.empty(a.shape, dtype=a.dtype).copy_(a)  # standard strides, even size 1
        except NotImplementedError:  # torch cannot copy some dtypes (float4): go through ints
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            dense = a.view(ints[a.dtype.itemsize]).contiguous().view(a.dtype)
        a_bytes = dense.reshape(-1).view(torch.uint8)
        b_bytes = b.reshape(-1).view(torch.uint8)
        assert torch.equal(a_bytes, b_bytes)


def assert_same(a: Any, b: Any) -> None:
    """``b`` is ``a`` rebuilt: same types all the way down, equal values, tensors bit for bit."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b)
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b
