"""Value codec: round trips of value trees, zero-copy on both sides, the cases that copy, errors."""

from __future__ import annotations

import enum
import gc
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.engines.sampling import SamplingParams
from mstar_async.errors import MstarError
from mstar_async.graph import StreamEnd
from mstar_async.policies import Chunk
from mstar_async.transport import (
    INLINE_TENSOR_BYTES,
    SUPPORTED_DTYPES,
    TransportError,
    decode_value,
    encode_value,
    register_wire_type,
    registered_wire_types,
    tensor_buffer,
    tensor_from_buffer,
)

from .support import (
    COMPLEX_HALF_WARNING,
    PROPERTY,
    address,
    assert_same,
    register_test_wire_types,
    tensors,
    values,
)

register_test_wire_types()


def round_trip(value: Any) -> Any:
    header, buffers = encode_value(value)
    return decode_value(header, buffers)


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@PROPERTY
@given(values)
def test_value_trees_round_trip(value: Any) -> None:
    assert_same(value, round_trip(value))


@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@PROPERTY
@given(tensors())
def test_tensors_round_trip_through_bytes_frames(tensor: torch.Tensor) -> None:
    # As if received with copy=True: bytes frames (read-only, so decode copies them).
    header, buffers = encode_value(tensor)
    out = decode_value(bytes(header), [bytes(b) for b in buffers])
    assert_same(tensor, out)


def test_every_common_dtype_is_supported() -> None:
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16"):
        assert getattr(torch, name) in SUPPORTED_DTYPES
    for name in ("float32", "float64", "complex64", "complex128", "uint16", "uint32", "uint64"):
        assert getattr(torch, name) in SUPPORTED_DTYPES


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.empty(0, dtype=torch.int64),
        torch.empty(3, 0, 2, dtype=torch.float16),
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).permute(2, 0, 1),
        torch.arange(10, dtype=torch.int64)[::3],
        torch.randn(4, 4, requires_grad=True),
        torch.randn(3, dtype=torch.complex64).conj(),
        torch.nn.Parameter(torch.ones(2)),
        torch._neg_view(torch.arange(3.0)),
    ],
    ids=[
        "bf16-0d",
        "bool-0d",
        "empty",
        "empty-3d",
        "permuted",
        "strided",
        "grad",
        "conj",
        "param",
        "neg-view",
    ],
)
def test_edge_tensors(tensor: torch.Tensor) -> None:
    out = round_trip(tensor)
    assert_same(tensor.detach().resolve_conj().resolve_neg(), out)
    assert not out.requires_grad


def test_chunk_sampling_params_and_stream_end_round_trip() -> None:
    data = torch.arange(12, dtype=torch.int16).reshape(6, 2)
    chunk = Chunk(data, start=7, context=2, lookahead=3, final=True)
    params = SamplingParams(
        temperature=0.7, top_k=5, seed=2**64 - 1, stop_token_ids=frozenset({1, 9})
    )
    value = {"chunk": chunk, "params": params, "pair": (chunk, [params]), "ended": StreamEnd()}
    out = round_trip(value)
    assert_same(value, out)
    assert out["chunk"] == chunk and out["params"] == params
    assert isinstance(out["ended"], StreamEnd)
    assert (out["chunk"].lookahead, out["chunk"].final) == (3, True)


def test_header_is_small_and_tensors_are_not_in_it() -> None:
    header, buffers = encode_value({"x": torch.zeros(1 << 16)})
    assert len(header) < 40
    assert [b.nbytes for b in buffers] == [1 << 18]


@st.composite
def tensors_near_the_inline_threshold(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of every dtype whose size is within a few elements of the inline threshold,
    1-D or 2-D, contiguous or a transposed view, with random bits (NaN payloads included)."""
    dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
    around = INLINE_TENSOR_BYTES // dtype.itemsize
    numel = draw(st.integers(around - 3, around + 3))
    bits = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=bits)
    flat = raw.view(dtype)
    if draw(st.booleans()) and numel % 2 == 0:
        return flat.reshape(2, numel // 2).t()
    return flat


@pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)
@PROPERTY
@given(tensors_near_the_inline_threshold())
def test_tensors_inline_below_the_threshold_and_frame_from_it(tensor: torch.Tensor) -> None:
    header, buffers = encode_value({"x": tensor})
    inline = tensor.numel() * tensor.dtype.itemsize < INLINE_TENSOR_BYTES
    assert len(buffers) == (0 if inline else 1)
    assert (len(header) > INLINE_TENSOR_BYTES // 2) == inline
    assert_same(tensor, decode_value(header, [bytearray(b) for b in buffers])["x"])
    if inline:  # a tensor from the header owns its memory: writing it leaves the header alone
        decode_value(header, [])["x"].view(torch.uint8).fill_(1)
        assert_same(tensor, decode_value(header, [])["x"])


def test_decode_step_inputs_travel_in_the_header_alone() -> None:
    inputs = {
        "tokens": torch.arange(8, dtype=torch.int64),
        "positions": torch.arange(100, 108, dtype=torch.int64),
        "block_table": torch.arange(16, dtype=torch.int32).reshape(1, 16),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3, dtype=torch.float16),
    }
    header, buffers = encode_value(inputs)
    assert buffers == []
    assert len(header) < 194 + 128  # the 194 bytes of data, names and a few per tensor
    assert_same(inputs, decode_value(bytes(header), []))


def test_inline_tensor_with_wrong_size_is_refused() -> None:
    header, _ = encode_value(torch.arange(4, dtype=torch.int32))
    ext = msgspec.msgpack.decode(header)  # the codec's ext value, undecoded
    short = msgspec.msgpack.encode(msgspec.msgpack.Ext(ext.code, bytes(ext.data)[:-4]))
    with pytest.raises(TransportError, match="inline tensor holds 12 bytes"):
        decode_value(short, [])


# ---- zero copy ------------------------------------------------------------------------------


def test_encode_shares_memory_with_the_tensor() -> None:
    tensor = torch.randn(1 << 16).to(torch.bfloat16)
    _, buffers = encode_value({"x": tensor})
    assert address(buffers[0]) == tensor.data_ptr()
    assert buffers[0].nbytes == tensor.numel() * 2
    # ...and so does the ZeroMQ frame built from it, as send_multipart(copy=False) builds it.
    frame = zmq.Frame(buffers[0], copy=False)
    assert address(frame.buffer) == tensor.data_ptr()


def test_the_buffer_keeps_the_tensor_alive() -> None:
    _, buffer = tensor_buffer(torch.full((1000,), 7, dtype=torch.int32))
    gc.collect()
    assert tensor_from_buffer(bytearray(buffer), "int32", (1000,)).eq(7).all()


def test_decode_shares_memory_with_a_writable_frame() -> None:
    tensor = torch.arange(1 << 14, dtype=torch.float32).reshape(128, 128)
    header, buffers = encode_value(tensor)
    frame = zmq.Frame(bytes(buffers[0]))  # a frame owning a copy, as a received one does
    refs = sys.getrefcount(frame)
    out = decode_value(header, [frame])
    start = address(frame.buffer)
    assert start <= out.data_ptr() < start + len(frame)
    assert sys.getrefcount(frame) > refs  # the tensor holds the frame
    del frame
    gc.collect()
    assert torch.equal(out, tensor)  # memory still valid without our reference


def test_in_process_decode_aliases_the_original() -> None:
    tensor = torch.arange(INLINE_TENSOR_BYTES // 8, dtype=torch.int64)
    out = round_trip(tensor)
    assert out.data_ptr() == tensor.data_ptr()


def test_read_only_buffers_are_copied() -> None:
    raw = torch.arange(8, dtype=torch.int64).numpy().tobytes()
    out = tensor_from_buffer(raw, torch.int64, (2, 4))
    out.add_(1)  # must not write into the immutable bytes
    assert raw == torch.arange(8, dtype=torch.int64).numpy().tobytes()
    assert out[0, 0].item() == 1


def test_misaligned_buffers_are_copied_aligned() -> None:
    storage = bytearray(8 * 4 + 1)
    view = memoryview(storage)[1:]
    view[:] = torch.arange(4, dtype=torch.int64).numpy().tobytes()
    out = tensor_from_buffer(view, "int64", (4,))
    assert out.data_ptr() % 8 == 0
    assert out.tolist() == [0, 1, 2, 3]


def test_non_cpu_style_copies_are_made_contiguous() -> None:
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    meta, buffer = tensor_buffer(base.t())
    assert meta.shape == (4, 3) and meta.dtype == "float64"
    assert address(buffer) != base.data_ptr()  # a non-contiguous tensor is copied once


# ---- errors ---------------------------------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: int


class Color(enum.IntEnum):
    RED = 1


@dataclass
class Unregistered:
    x: int


@pytest.mark.parametrize(
    "value",
    [object(), Point(1, 2), Color.RED, torch.Size([2]), Unregistered(1), 1 + 2j, bytearray(b"x")],
    ids=["object", "namedtuple", "intenum", "size", "dataclass", "complex", "bytearray"],
)
def test_unknown_types_name_the_type_and_the_fix(value: Any) -> None:
    with pytest.raises(TransportError, match="register_wire_type") as info:
        encode_value({"nested": [value]})
    assert type(value).__qualname__ in str(info.value)
    assert isinstance(info.value, MstarError)


def test_non_str_dict_keys_are_refused() -> None:
    with pytest.raises(TransportError, match="keys must be str"):
        encode_value({1: "x"})


def test_ints_beyond_64_bits_are_refused() -> None:
    with pytest.raises(TransportError, match="encode"):
        encode_value([2**64])


def test_unsupported_tensor_kinds_are_refused() -> None:
    with pytest.raises(TransportError, match="sparse|layout"):
        encode_value(torch.eye(3).to_sparse())
    with pytest.raises(TransportError, match="dtype torch.bits8"):
        encode_value(torch.empty(2, dtype=torch.bits8))
    with pytest.raises(TransportError, match="meta"):
        encode_value(torch.empty(2, device="meta"))


def test_unregistered_name_on_decode_is_a_transport_error() -> None:
    @dataclass(frozen=True)
    class Local:
        n: int

    register_wire_type(Local, name="tests.transport.Local")
    header, buffers = encode_value(Local(3))
    assert round_trip(Local(3)) == Local(3)
    from mstar_async.transport import codec

    entry = codec._TYPES_BY_NAME.pop("tests.transport.Local")
    try:
        with pytest.raises(TransportError, match="not registered here"):
            decode_value(header, buffers)
    finally:
        codec._TYPES_BY_NAME[entry.name] = entry


def test_registration_rules() -> None:
    with pytest.raises(TypeError, match="dataclass"):
        register_wire_type(int)
    register_wire_type(Chunk) if Chunk not in registered_wire_types().values() else None
    register_wire_type(SamplingParams, name=_name_of(SamplingParams))  # same again: fine

    @dataclass
    class Other:
        y: int = field(default=0)

    with pytest.raises(ValueError, match="already registered"):
        register_wire_type(Other, name=_name_of(Chunk))


def _name_of(cls: type) -> str:
    return next(name for name, known in registered_wire_types().items() if known is cls)


INT64 = 5  # the wire code of int64


def _frame_tensor(frame: int, code: int, shape: tuple[int, ...]) -> bytes:
    """A header holding one frame-tensor ext value, laid out by hand as the codec lays it."""
    payload = struct.pack(f"<iBB{len(shape)}q", frame, code, len(shape), *shape)
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(1, payload))


@pytest.mark.parametrize(
    "header, buffers, match",
    [
        (b"\xc1", [], "malformed"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"")), [], "ext code 9"),
        (_frame_tensor(3, INT64, (2,)), [], "frame 3"),
        (_frame_tensor(0, 250, (2,)), [b"x"], "dtype code 250"),
        (_frame_tensor(0, INT64, (2,)), [b"x"], "bytes"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x00\x01")), [], "malformed"),
    ],
    ids=["garbage", "unknown-ext", "missing-frame", "bad-dtype", "short-frame", "truncated"],
)
def test_malformed_input_is_a_transport_error(
    header: bytes, buffers: list[bytes], match: str
) -> None:
    with pytest.raises(TransportError, match=match):
        decode_value(header, buffers)


def test_rejected_field_values_are_transport_errors() -> None:
    header, buffers = encode_value(Chunk([1, 2], start=0))
    bad = header.replace(b"\x92\x01\x02\x00", b"\x92\x01\x02\xff")  # start = -1
    assert bad != header
    with pytest.raises(TransportError, match="start"):
        decode_value(bad, buffers)
