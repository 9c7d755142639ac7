"""Messages between the conductor and workers, and the ways they travel.

In one process values are handed over as Python objects, tensors and all (a ``StepCall`` is
one step for a worker's batching loop); across processes a message travels as a small typed
header plus raw tensor frames:

- :mod:`~mstar_async.transport.codec`: value trees <-> msgpack header + zero-copy tensor
  buffers; :func:`register_wire_type` lets a dataclass travel;
- :mod:`~mstar_async.transport.wire`: the message structs and :func:`encode_message` /
  :func:`decode_message`;
- :mod:`~mstar_async.transport.shm`: shared-memory segments that carry large tensors between
  processes on one host (IPC links use them for tensors of :data:`SHM_TENSOR_BYTES` or more);
- :mod:`~mstar_async.transport.zmq_link`: :class:`ZmqHub`, the ROUTER :class:`Server` and the
  DEALER :class:`Link` over ``zmq.asyncio`` (IPC and TCP);
- :mod:`~mstar_async.transport.curve` and :mod:`~mstar_async.transport.secure`: the CURVE keys
  that authenticate and encrypt TCP sockets, and how a socket uses them.
"""

from __future__ import annotations

from mstar_async.transport.codec import (
    INLINE_TENSOR_BYTES,
    SUPPORTED_DTYPES,
    TensorMeta,
    decode_value,
    encode_value,
    register_wire_type,
    registered_wire_types,
    tensor_buffer,
    tensor_from_buffer,
)
from mstar_async.transport.curve import CurveClient, CurveKeys, CurveServer, generate_curve_keys
from mstar_async.transport.errors import (
    RemoteError,
    TransportError,
    lookup_remote_error,
    register_remote_error,
    remote_error_name,
)
from mstar_async.transport.messages import DROP_OP, EXPORT_OP, IMPORT_OP, StepCall, TensorRef
from mstar_async.transport.shm import SHM_TENSOR_BYTES
from mstar_async.transport.wire import (
    AFTER_UNIT,
    STATE_MOVED,
    UNIT_DONE,
    DropState,
    ErrorInfo,
    FeedWalk,
    FetchState,
    FetchTensor,
    Hello,
    Message,
    Peers,
    PeerWalks,
    Ping,
    Pong,
    Release,
    Shutdown,
    StartWalk,
    StateReply,
    TensorReply,
    WalkCredit,
    WalkUpdates,
    decode_message,
    encode_message,
)
from mstar_async.transport.zmq_link import Link, Server, ZmqHub

__all__ = [
    "AFTER_UNIT",
    "DROP_OP",
    "EXPORT_OP",
    "IMPORT_OP",
    "INLINE_TENSOR_BYTES",
    "SHM_TENSOR_BYTES",
    "STATE_MOVED",
    "SUPPORTED_DTYPES",
    "UNIT_DONE",
    "CurveClient",
    "CurveKeys",
    "CurveServer",
    "DropState",
    "ErrorInfo",
    "FeedWalk",
    "FetchState",
    "FetchTensor",
    "Hello",
    "Link",
    "Message",
    "PeerWalks",
    "Peers",
    "Ping",
    "Pong",
    "Release",
    "RemoteError",
    "Server",
    "Shutdown",
    "StartWalk",
    "StateReply",
    "StepCall",
    "TensorMeta",
    "TensorRef",
    "TensorReply",
    "TransportError",
    "WalkCredit",
    "WalkUpdates",
    "ZmqHub",
    "decode_message",
    "decode_value",
    "encode_message",
    "encode_value",
    "generate_curve_keys",
    "lookup_remote_error",
    "register_remote_error",
    "register_wire_type",
    "registered_wire_types",
    "remote_error_name",
    "tensor_buffer",
    "tensor_from_buffer",
]
