"""Value codec: a tree of Python values <-> one msgpack header plus raw tensor buffers.

A value tree is made of ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``,
``list``, ``tuple``, ``set``, ``frozenset``, ``dict`` with ``str`` keys, CPU tensors and
registered dataclasses (:func:`register_wire_type`). Types are matched exactly: a subclass of
``tuple`` or ``int`` (a ``NamedTuple``, an ``IntEnum``, ``torch.Size``) is refused rather than
silently turned into its base, so what comes out is what went in.

Wire layout. The header is msgpack (msgspec). Lists, dicts and scalars are plain msgpack;
the other kinds are msgpack *ext* values:

==========  =========================================================================
ext code    payload
==========  =========================================================================
1 tensor    little-endian ``int32 frame, uint8 dtype code, uint8 ndim, int64 dims[ndim]``;
            the bytes are buffer ``frame``
2 tuple     msgpack array of the items
3 dataclass msgpack ``[registered name, [init field values in declaration order]]``
4 set       msgpack array of the items
5 frozenset msgpack array of the items
6 inline    ``uint8 dtype code, uint8 ndim, int64 dims[ndim]`` then the tensor's bytes
7 shm       ``uint8 dtype code, uint8 ndim, int64 dims[ndim]`` then the name (UTF-8) of
            the shared-memory segment that holds the bytes
==========  =========================================================================

Small tensors inline. A tensor of fewer than :data:`INLINE_TENSOR_BYTES` bytes (a decode
step's token ids, positions, block table) travels inside the header (ext 6): a frame costs a
``zmq.Frame`` on each side and a tensor built over foreign memory, several microseconds,
while copying a few hundred bytes costs a fraction of one. Larger tensors travel as frames.

Large tensors through shared memory. When the encoder is given an
:class:`~mstar_async.transport.shm.ShmBatch` (links over IPC, between processes of one host,
do this), tensors of at least :data:`~mstar_async.transport.shm.SHM_TENSOR_BYTES` are copied
once into a shared-memory segment and only its name travels (ext 7); the decoder maps the
segment and builds the tensor over it, no copy (see :mod:`mstar_async.transport.shm` for
who owns the segment and when it is reused). Any process on the host can decode such a
message; one on another host cannot, so TCP links never use it.

Copies. Encoding copies no frame tensor's bytes: each buffer is a ``memoryview`` over the
tensor's own storage (through ``Tensor.numpy()``, reinterpreted as a same-width integer type
for dtypes numpy lacks, e.g. bfloat16 as int16). Only tensors that are not plain CPU memory
are copied first: non-contiguous ones (``.contiguous()``), ones off the CPU (``.cpu()``) and
ones with a lazy conjugate/negative bit. Decoding copies no frame tensor's bytes either: the
tensor is built over the received buffer (a numpy array over the buffer, then
``torch.from_numpy``) and holds a reference to it, so a ``zmq.Frame`` stays alive as long as
any tensor made from it. Two cases copy on decode: a read-only buffer (``bytes``) is copied so
that no tensor ever aliases immutable memory, and a buffer whose address is not a multiple of
the element size is copied so that kernels see aligned data. Inline tensors are copied once
each way (into the header, out of it into memory of their own).
Over ZeroMQ, pyzmq itself copies frames smaller than ``zmq.COPY_THRESHOLD`` (64 KiB) on send,
which is cheaper than sharing memory for small frames.

A sent tensor shares memory with the frame until ZeroMQ has written it out: do not modify a
tensor in place after handing it to ``encode_value`` / a link's ``send``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from mstar_async.transport import shm
from mstar_async.transport.errors import TransportError

__all__ = [
    "INLINE_TENSOR_BYTES",
    "SUPPORTED_DTYPES",
    "Buffer",
    "TensorMeta",
    "decode_value",
    "decode_wire",
    "encode_value",
    "ext_hook",
    "register_wire_type",
    "registered_wire_types",
    "tensor_buffer",
    "tensor_from_buffer",
    "to_wire",
]

T = TypeVar("T")

# Anything with the buffer protocol that ZeroMQ can send or we can decode from: bytes,
# bytearray, memoryview, numpy arrays, zmq.Frame.
Buffer = Any

_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_DATACLASS = 3
_EXT_SET = 4
_EXT_FROZENSET = 5
_EXT_INLINE = 6
_EXT_SHM = 7

#: Tensors of fewer bytes than this travel inside the msgpack header; larger ones as frames.
#: Below it, a frame's fixed cost (a zmq.Frame each side, a tensor over a foreign buffer)
#: outweighs copying the bytes into the header.
INLINE_TENSOR_BYTES = 4096


class TensorMeta(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where a tensor's bytes are and how to read them.

    Attributes:
        frame: index of the buffer that holds the bytes (in the message's buffer list);
            -1 for a tensor with no elements, which sends no buffer.
        dtype: torch dtype name without ``torch.`` (``"bfloat16"``).
        shape: the tensor's shape; ``()`` for a 0-dim tensor.
    """

    frame: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _DType:
    dtype: torch.dtype
    # Same-width dtype that Tensor.numpy() accepts; the bytes are reinterpreted, never converted.
    view: torch.dtype
    itemsize: int
    numpy: np.dtype[Any]  # numpy's twin of ``view``


_NUMPY_NATIVE = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
# dtypes numpy has no type for; they travel as integers of the same width.
_VIA_INTEGER = (
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _dtype_table() -> tuple[dict[str, _DType], dict[torch.dtype, str]]:
    by_name: dict[str, _DType] = {}
    for name in _NUMPY_NATIVE + _VIA_INTEGER:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue  # an older torch without this dtype
        view = dtype if name in _NUMPY_NATIVE else _INT_OF_WIDTH[dtype.itemsize]
        by_name[name] = _DType(
            dtype, view, dtype.itemsize, torch.empty(0, dtype=view).numpy().dtype
        )
    return by_name, {d.dtype: name for name, d in by_name.items()}


_DTYPES, _DTYPE_NAME = _dtype_table()

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(d.dtype for d in _DTYPES.values())
"""Every tensor dtype the codec carries (those this torch build has)."""


@dataclass(frozen=True, slots=True)
class _WireType:
    cls: type[Any]
    name: str
    fields: tuple[str, ...]
    positional: bool  # every init field can be passed by position (none is keyword-only)
    values: Callable[[Any], Sequence[Any]]  # an instance's init field values, in order


_TYPES_BY_CLASS: dict[type[Any], _WireType] = {}
_TYPES_BY_NAME: dict[str, _WireType] = {}


def register_wire_type(cls: type[T], *, name: str | None = None) -> type[T]:
    """Let instances of the dataclass ``cls`` travel in value trees.

    An instance travels as its registered name plus the values of its ``init`` fields (each a
    value tree itself) and is rebuilt on the other side by calling ``cls(**fields)``, so
    ``__post_init__`` checks run again there. Fields with ``init=False`` are not sent.
    ``name`` defaults to ``"module.QualName"``; both sides must register the class under the
    same name. Registering the same class under the same name again is a no-op, so every
    process can run the same registration code; usable as a decorator.

    Raises:
        TypeError: ``cls`` is not a dataclass type.
        ValueError: ``name`` is taken by another class, or ``cls`` is registered under
            another name.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_wire_type: expected a dataclass type, got {cls!r}")
    key = f"{cls.__module__}.{cls.__qualname__}" if name is None else name
    taken = _TYPES_BY_NAME.get(key)
    if taken is not None and taken.cls is not cls:
        raise ValueError(
            f"register_wire_type: name {key!r} is already registered for "
            f"{taken.cls.__module__}.{taken.cls.__qualname__}"
        )
    known = _TYPES_BY_CLASS.get(cls)
    if known is not None and known.name != key:
        raise ValueError(
            f"register_wire_type: {cls.__qualname__} is already registered as {known.name!r}"
        )
    init = [f for f in dataclasses.fields(cls) if f.init]
    positional = not any(f.kw_only for f in init)
    names = tuple(f.name for f in init)
    entry = _WireType(cls, key, names, positional, _field_getter(names))
    _TYPES_BY_CLASS[cls] = entry
    _TYPES_BY_NAME[key] = entry
    return cls


def _field_getter(names: tuple[str, ...]) -> Callable[[Any], Sequence[Any]]:
    if not names:
        return lambda _: ()
    if len(names) == 1:  # attrgetter of one name returns the value, not a 1-tuple
        get = operator.attrgetter(names[0])
        return lambda value: (get(value),)
    return operator.attrgetter(*names)


def registered_wire_types() -> dict[str, type[Any]]:
    """A snapshot of the registry: registered name -> class. Never raises."""
    return {name: entry.cls for name, entry in _TYPES_BY_NAME.items()}


# ---------------------------------------------------------------------------------------------
# tensors


def tensor_buffer(tensor: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    """A buffer over ``tensor``'s bytes, and the meta to rebuild it (``frame`` left at -1).

    Zero-copy for a contiguous CPU tensor with no lazy conjugate/negative bit: the
    ``memoryview`` points at the tensor's storage and keeps the tensor alive. Other tensors
    are first copied to one that is. Not for use with a tensor you modify later in place.

    Raises:
        TransportError: the dtype or layout cannot travel (quantized, sparse), or the tensor
            cannot be copied to the CPU (a meta tensor).
    """
    name, shape, buffer = _tensor_bytes(tensor)
    return TensorMeta(-1, name, shape), buffer


def tensor_from_buffer(
    buffer: Buffer, dtype: str | torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buffer``'s bytes, sharing its memory.

    The tensor keeps ``buffer`` alive. It copies instead when ``buffer`` is read-only (so no
    tensor aliases immutable memory) or misaligned for the element size.

    Raises:
        TransportError: unknown dtype, or the buffer's size does not match ``shape``.
    """
    name = dtype if isinstance(dtype, str) else _DTYPE_NAME.get(dtype)
    info = _DTYPES.get(name) if name is not None else None
    if info is None:
        raise TransportError(f"unknown tensor dtype {dtype!r} in a message")
    view = memoryview(buffer)
    numel = math.prod(shape)
    if view.nbytes != numel * info.itemsize:
        raise TransportError(
            f"tensor frame holds {view.nbytes} bytes, but {info.dtype} {tuple(shape)} "
            f"needs {numel * info.itemsize}"
        )
    if numel == 0:
        return torch.empty(tuple(shape), dtype=info.dtype)
    if view.readonly:
        view = memoryview(bytearray(view))
    # numpy builds the shaped array over the buffer in a fraction of what torch.frombuffer plus
    # a view costs; the array references the buffer and the tensor references the array.
    t = torch.from_numpy(np.ndarray(tuple(shape), info.numpy, view))
    if info.view is not info.dtype:
        t = t.view(info.dtype)
    if t.data_ptr() % info.itemsize:
        t = t.clone()
    return t


# ---------------------------------------------------------------------------------------------
# encoding

_encoder = msgspec.msgpack.Encoder()
_Ext = msgspec.msgpack.Ext

# Stable dtype codes for the wire: positions in the full name list, whether or not this torch
# build has the dtype, so two builds that both have one agree on its code.
_CODE_OF: dict[str, int] = {name: i for i, name in enumerate(_NUMPY_NATIVE + _VIA_INTEGER)}
_BY_CODE: dict[int, _DType] = {_CODE_OF[name]: info for name, info in _DTYPES.items()}
_CODE_OF_DTYPE: dict[torch.dtype, int] = {info.dtype: code for code, info in _BY_CODE.items()}
# Only these carry a lazy conjugate bit; asking any other tensor costs a torch call per tensor.
_COMPLEX = frozenset(d for d in _DTYPE_NAME if d.is_complex)
_STRIDED = torch.strided
# (frame index, dtype code, ndim) then ndim int64 dims; inline tensors drop the frame index.
_FRAME_HEAD = struct.Struct("<iBB")
_DIMS: dict[int, struct.Struct] = {}
_INLINE_HEADS: dict[int, struct.Struct] = {}  # ndim -> (dtype code, ndim, dims), one call
_SCALARS = frozenset({type(None), str, int, float, bool, bytes})


def _dims(ndim: int) -> struct.Struct:
    packer = _DIMS.get(ndim)
    if packer is None:
        packer = _DIMS[ndim] = struct.Struct(f"<{ndim}q")
    return packer


def _inline_head(ndim: int) -> struct.Struct:
    packer = _INLINE_HEADS.get(ndim)
    if packer is None:
        packer = _INLINE_HEADS[ndim] = struct.Struct(f"<BB{ndim}q")
    return packer


def _unsupported(value: object) -> TransportError:
    tp = type(value)
    return TransportError(
        f"cannot send a value of type {tp.__module__}.{tp.__qualname__}: values must be None, "
        "bool, int, float, str, bytes, list, tuple, set, frozenset, dict with str keys, "
        "torch.Tensor, or a dataclass registered with "
        "mstar_async.transport.register_wire_type(cls) on both sides"
    )


def _plain(tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The dtype name and a contiguous CPU tensor with no lazy bits holding ``tensor``'s
    values: ``tensor`` itself in the common case, else a copy."""
    name = _DTYPE_NAME.get(tensor.dtype)
    if name is None or tensor.layout != torch.strided:
        raise TransportError(
            f"cannot send a tensor of dtype {tensor.dtype} and layout {tensor.layout}; "
            f"supported: strided tensors of {', '.join(_DTYPES)}"
        )
    # Each step below is skipped for the common tensor (CPU, contiguous, no grad): this runs
    # for every tensor of every step, and each torch call costs about a microsecond.
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        try:
            t = t.cpu()  # a copy; the receiver gets a CPU tensor and places it itself
        except (NotImplementedError, RuntimeError) as exc:
            raise TransportError(f"cannot send a tensor on {t.device}: {exc}") from exc
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        # Through the same-width integer type: torch cannot copy some dtypes (float4) itself.
        view = _DTYPES[name].view
        t = t.contiguous() if view is t.dtype else t.view(view).contiguous().view(t.dtype)
    return name, t


def _tensor_bytes(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    name, t = _plain(tensor)
    view = _DTYPES[name].view
    array = (t if view is t.dtype else t.view(view)).numpy()
    return name, tuple(t.shape), array.data


def _encode_tensor(tensor: torch.Tensor, buffers: list[Buffer]) -> msgspec.msgpack.Ext:
    dtype = tensor.dtype
    code = _CODE_OF_DTYPE.get(dtype)
    if (
        code is not None
        and tensor.layout is _STRIDED
        and tensor.is_cpu
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and not tensor.is_neg()
        and (dtype not in _COMPLEX or not tensor.is_conj())
    ):
        # The decode-step case, a small plain tensor, in as few torch calls as it takes: each
        # costs a tenth of a microsecond or more, and a step carries several such tensors.
        nbytes = tensor.nbytes
        if nbytes < INLINE_TENSOR_BYTES:
            shape = tensor.shape
            ndim = len(shape)
            head = (_INLINE_HEADS.get(ndim) or _inline_head(ndim)).pack(code, ndim, *shape)
            return _Ext(_EXT_INLINE, head + ctypes.string_at(tensor.data_ptr(), nbytes))
    name, t = _plain(tensor)
    shape = t.shape
    ndim = len(shape)
    nbytes = t.nbytes
    if nbytes < INLINE_TENSOR_BYTES:
        # One copy of a few bytes into the header beats a frame: each frame costs a zmq.Frame
        # and a tensor over it on the other side, several microseconds.
        head = _inline_head(ndim).pack(_CODE_OF[name], ndim, *shape)
        return _Ext(_EXT_INLINE, head + ctypes.string_at(t.data_ptr(), nbytes))
    view = _DTYPES[name].view
    data = (t if view is t.dtype else t.view(view)).numpy().data
    if nbytes >= shm.SHM_TENSOR_BYTES:
        batch: shm.ShmBatch | None = getattr(_encoding, "shm", None)
        if batch is not None:
            head = _inline_head(ndim).pack(_CODE_OF[name], ndim, *shape)
            return _Ext(_EXT_SHM, head + batch.write(data).encode())
    buffers.append(data)
    head = _FRAME_HEAD.pack(len(buffers) - 1, _CODE_OF[name], ndim)
    return _Ext(_EXT_TENSOR, head + _dims(ndim).pack(*shape))


def _encode_list(value: list[Any], buffers: list[Buffer]) -> Any:
    return [item if type(item) in _SCALARS else _to_wire(item, buffers) for item in value]


def _encode_dict(value: dict[Any, Any], buffers: list[Buffer]) -> Any:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if type(key) is not str:
            raise TransportError(
                f"cannot send a dict with a key of type {type(key).__qualname__} "
                f"({key!r}); dict keys must be str"
            )
        out[key] = item if type(item) in _SCALARS else _to_wire(item, buffers)
    return out


def _encode_tuple(value: tuple[Any, ...], buffers: list[Buffer]) -> Any:
    return _Ext(_EXT_TUPLE, _encode([_to_wire(item, buffers) for item in value]))


def _encode_set(value: set[Any], buffers: list[Buffer]) -> Any:
    return _Ext(_EXT_SET, _encode([_to_wire(item, buffers) for item in value]))


def _encode_frozenset(value: frozenset[Any], buffers: list[Buffer]) -> Any:
    return _Ext(_EXT_FROZENSET, _encode([_to_wire(item, buffers) for item in value]))


_ENCODERS: dict[type[Any], Callable[[Any, list[Buffer]], Any]] = {
    dict: _encode_dict,
    list: _encode_list,
    torch.Tensor: _encode_tensor,
    tuple: _encode_tuple,
    set: _encode_set,
    frozenset: _encode_frozenset,
}


# The shared-memory batch of the message being encoded (None: tensors go in frames); set by
# to_wire around one encoding, per thread, like the decoder's buffers below.
_encoding = threading.local()


def to_wire(value: Any, buffers: list[Buffer], shm_batch: shm.ShmBatch | None = None) -> Any:
    """``value`` as a tree msgspec can encode: tensors and non-msgpack kinds become ext values.

    Tensors of at least :data:`INLINE_TENSOR_BYTES` append their buffer to ``buffers`` (the
    index goes in the header); smaller ones travel inside the header. With ``shm_batch``,
    tensors of at least :data:`~mstar_async.transport.shm.SHM_TENSOR_BYTES` are copied into
    its pool's shared-memory segments instead (only for a receiver on this host; on a failed
    send, ``shm_batch.cancel()``). Use this to embed a value tree in a larger msgspec message,
    as :mod:`mstar_async.transport.wire` does.

    Raises:
        TransportError: a value of a type that cannot travel (the message names the type and
            how to register it), a dict key that is not a str, or a segment that cannot be
            made.
    """
    if shm_batch is None:
        return _to_wire(value, buffers)
    saved = getattr(_encoding, "shm", None)
    _encoding.shm = shm_batch
    try:
        return _to_wire(value, buffers)
    finally:
        _encoding.shm = saved


def _to_wire(value: Any, buffers: list[Buffer]) -> Any:
    tp = type(value)
    if tp in _SCALARS:
        return value
    encode = _ENCODERS.get(tp)
    if encode is not None:
        return encode(value, buffers)
    wire_type = _TYPES_BY_CLASS.get(tp)
    if wire_type is not None:
        fields = [
            item if type(item) in _SCALARS else _to_wire(item, buffers)
            for item in wire_type.values(value)
        ]
        return _Ext(_EXT_DATACLASS, _encode([wire_type.name, fields]))
    if isinstance(value, torch.Tensor):  # a subclass, e.g. nn.Parameter
        return _encode_tensor(value, buffers)
    raise _unsupported(value)


def _encode(tree: Any) -> bytes:
    try:
        return _encoder.encode(tree)
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        # ints beyond 64 bits are the only way a tree from to_wire can fail here
        raise TransportError(f"cannot encode value: {exc}") from exc


def encode_value(
    value: Any, *, shm_batch: shm.ShmBatch | None = None
) -> tuple[bytes, list[Buffer]]:
    """Encode a value tree as ``(header, buffers)``: small tensors inside the header, the bytes
    of the others as the buffers, uncopied (or, with ``shm_batch``, large ones in shared
    memory, see :func:`to_wire`).

    Send it as the multipart message ``[header, *buffers]``. Synchronous, no I/O.

    Raises:
        TransportError: a value that cannot travel; the message names its type.
    """
    buffers: list[Buffer] = []
    return _encode(to_wire(value, buffers, shm_batch)), buffers


# ---------------------------------------------------------------------------------------------
# decoding

# The buffers of the message being decoded: msgspec calls the ext hook with no context of ours,
# and building a Decoder per message costs more than the whole header. Per thread, saved and
# restored around each decode so nested and concurrent (threaded) decodes stay apart.
_current = threading.local()


def _dtype_of(code: int) -> _DType:
    info = _BY_CODE.get(code)
    if info is None:
        raise TransportError(f"unknown tensor dtype code {code} in a message")
    return info


def _decode_frame_tensor(data: memoryview) -> torch.Tensor:
    frame, code, ndim = _FRAME_HEAD.unpack_from(data)
    shape = _dims(ndim).unpack_from(data, _FRAME_HEAD.size)
    info = _dtype_of(code)
    buffers: Sequence[Buffer] = _current.buffers
    if not 0 <= frame < len(buffers):
        raise TransportError(f"message refers to tensor frame {frame} but carries {len(buffers)}")
    return tensor_from_buffer(buffers[frame], info.dtype, shape)


def _decode_inline_tensor(data: memoryview) -> torch.Tensor:
    ndim = data[1]
    head = _INLINE_HEADS.get(ndim) or _inline_head(ndim)
    code, _, *dims = head.unpack_from(data)
    info = _BY_CODE.get(code) or _dtype_of(code)
    nbytes = len(data) - head.size
    numel = dims[0] if ndim == 1 else math.prod(dims)
    if nbytes != numel * info.itemsize:
        raise TransportError(
            f"inline tensor holds {nbytes} bytes, but {info.dtype} {tuple(dims)} needs "
            f"{numel * info.itemsize}"
        )
    if nbytes == 0:
        return torch.empty(dims, dtype=info.dtype)
    # A private copy (the header's memory is read-only and shared): a bytearray is malloc'd, so
    # aligned for any element size.
    own = bytearray(data[head.size :])
    if ndim == 1:  # the common case (token ids, positions): one call
        return torch.frombuffer(own, dtype=info.dtype)
    t = torch.from_numpy(np.ndarray(dims, info.numpy, own))
    return t if info.view is info.dtype else t.view(info.dtype)


def _decode_shm_tensor(data: memoryview) -> torch.Tensor:
    head = _inline_head(data[1])
    code, _, *dims = head.unpack_from(data)
    info = _dtype_of(code)
    try:
        name = bytes(data[head.size :]).decode()
    except UnicodeDecodeError as exc:
        raise TransportError(f"malformed shared-memory segment name: {exc}") from exc
    t = torch.from_numpy(shm.map_array(name, info.numpy, dims))
    return t if info.view is info.dtype else t.view(info.dtype)


def _decode_dataclass(data: memoryview) -> Any:
    name, values = _value_decoder.decode(data)
    wire_type = _TYPES_BY_NAME.get(name)
    if wire_type is None:
        raise TransportError(
            f"message carries a {name!r}, which is not registered here; call "
            "mstar_async.transport.register_wire_type(cls) in this process too"
        )
    if len(values) != len(wire_type.fields):
        raise TransportError(
            f"message carries {len(values)} fields for {name!r}, which has "
            f"{len(wire_type.fields)}; both sides must run the same code"
        )
    if wire_type.positional:  # a third faster than building keyword arguments
        return wire_type.cls(*values)
    return wire_type.cls(**dict(zip(wire_type.fields, values, strict=True)))


_EXT_DECODERS: dict[int, Callable[[memoryview], Any]] = {
    _EXT_INLINE: _decode_inline_tensor,
    _EXT_TENSOR: _decode_frame_tensor,
    _EXT_SHM: _decode_shm_tensor,
    _EXT_DATACLASS: _decode_dataclass,
    _EXT_TUPLE: lambda data: tuple(_value_decoder.decode(data)),
    _EXT_SET: lambda data: set(_value_decoder.decode(data)),
    _EXT_FROZENSET: lambda data: frozenset(_value_decoder.decode(data)),
}


def _ext_hook(code: int, data: memoryview) -> Any:
    decode = _EXT_DECODERS.get(code)
    if decode is None:
        raise TransportError(f"unknown msgpack ext code {code} in a message")
    return decode(data)


_value_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_wire(decode: Callable[[Buffer], T], header: Buffer, buffers: Sequence[Buffer]) -> T:
    """Run ``decode(header)`` (a msgspec decoder built with this module's ext hook) with
    ``buffers`` as the message's tensor frames; for messages that embed value trees.

    Raises:
        TransportError: a malformed header, an unregistered dataclass name, a frame index
            or size that does not fit, or a field value rejected by the class.
    """
    saved = getattr(_current, "buffers", None)
    _current.buffers = buffers
    try:
        return decode(header)
    except TransportError:
        raise
    except (msgspec.DecodeError, TypeError, ValueError, struct.error) as exc:
        raise TransportError(f"malformed message: {exc}") from exc
    finally:
        _current.buffers = saved


def decode_value(header: Buffer, buffers: Sequence[Buffer]) -> Any:
    """Rebuild the value tree that :func:`encode_value` encoded.

    Tensors from frames share memory with ``buffers`` (see the module notes for the two cases
    that copy); tensors from the header own a copy. Synchronous, no I/O.

    Raises:
        TransportError: see :func:`decode_wire`.
    """
    return decode_wire(_value_decoder.decode, header, buffers)


def ext_hook() -> Callable[[int, memoryview], Any]:
    """The msgspec ``ext_hook`` that turns this codec's ext values back into Python values;
    pass it to a ``msgspec.msgpack.Decoder`` and call it through :func:`decode_wire`."""
    return _ext_hook
