"""What the conductor and workers say to each other across processes, and how it is framed.

Every message is one ``msgspec.Struct`` of the tagged union :data:`Message`. On the wire a
message is the multipart ZeroMQ message ``[header, *buffers]``: ``header`` is the struct in
msgpack (compact: an array whose first item is the tag), and the fields that carry value trees
(``StartWalk.inputs``, ``FeedWalk.items``, ``WalkUpdates.events``, ``TensorReply.value``,
``StateReply.state``, ...) are encoded with :mod:`mstar_async.transport.codec`, so their
tensors travel as the ``buffers`` that follow, uncopied. In Python those fields hold the live
values: build ``FeedWalk(1, "node.port", {"x": tensor})``, ``encode_message`` it, and
``decode_message`` gives back a ``FeedWalk`` whose ``items`` holds tensors over the received
frames.

The conversation (the pool and the worker process run it). Walks run on the workers, so no
node step ever crosses on its own:

- worker -> conductor, once, when it is ready: :class:`Hello`;
- conductor -> worker: :class:`StartWalk`, :class:`FeedWalk` and :class:`WalkCredit` (a walk,
  its streamed inputs, credit and cancels), answered by :class:`WalkUpdates` (its outputs and
  end, one message per round); :class:`Release` (forget a request's state), :class:`Ping`
  (reply: :class:`Pong`), :class:`Shutdown`;
- conductor -> worker: :class:`Peers` (every rank's worker-to-worker endpoint, sent whenever a
  rank says ``Hello``);
- worker -> worker: :class:`FetchTensor` (the tensor behind a
  :class:`~mstar_async.transport.messages.TensorRef`), answered by :class:`TensorReply`;
- worker -> worker: :class:`FetchState` (a request's engine state, to run its next walk on
  the asking rank), answered by :class:`StateReply`, then :class:`DropState` once it arrived;
- worker -> worker: :class:`PeerWalks` (what the segments of walks that span ranks send each
  other: edge items and values, their credit, finished units), one message per round per peer."""

from __future__ import annotations

import traceback as _traceback
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from mstar_async.errors import MstarError
from mstar_async.transport.codec import (
    Buffer,
    decode_wire,
    ext_hook,
    register_wire_type,
    to_wire,
)
from mstar_async.transport.errors import (
    RemoteError,
    TransportError,
    lookup_remote_error,
    remote_error_name,
)
from mstar_async.transport.messages import TensorRef
from mstar_async.transport.shm import ShmBatch

__all__ = [
    "STATE_MOVED",
    "DropState",
    "ErrorInfo",
    "FetchState",
    "FetchTensor",
    "Hello",
    "Message",
    "PeerWalks",
    "Peers",
    "Ping",
    "Pong",
    "Release",
    "Shutdown",
    "StateReply",
    "TensorReply",
    "decode_message",
    "encode_message",
]


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An exception in transit: its class name, message and (optionally) formatted traceback.

    Build one with :meth:`from_exception`; turn it back into an exception with
    :meth:`to_exception`, which picks the class by name from
    :func:`~mstar_async.transport.errors.register_remote_error`'s table.
    """

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, *, with_traceback: bool = True) -> ErrorInfo:
        """Describe ``exc`` for the other side. Never raises."""
        tb = "".join(_traceback.format_exception(exc)) if with_traceback else ""
        message = exc.remote_message if isinstance(exc, RemoteError) else str(exc)
        return cls(remote_error_name(exc), message, tb)

    def to_exception(self) -> MstarError:
        """The exception to raise here: an instance of the registered class of that name,
        else :class:`RemoteError` carrying the remote class name. The remote traceback, if
        any, is attached as a note. Never raises (returns the exception)."""
        cls = lookup_remote_error(self.type)
        exc: MstarError
        if cls is None:
            exc = RemoteError(self.type, self.message)
        else:
            try:
                exc = cls(self.message)
            except Exception:  # a registered class with another constructor signature
                exc = RemoteError(self.type, self.message)
        if self.traceback:
            exc.add_note(f"remote traceback:\n{self.traceback}")
        return exc


class _Msg(msgspec.Struct, array_like=True, frozen=True):
    # Fields that hold value trees (tensors, registered dataclasses); encode_message runs them
    # through the value codec.
    __wire_values__: ClassVar[tuple[str, ...]] = ()


class Hello(_Msg, frozen=True, tag="hello", gc=False):
    """A worker is up: its rank, process id, the endpoint it serves and the engines it runs.

    ``peer_endpoint`` is where other workers fetch the tensors it holds ("" when it holds none).
    """

    rank: int
    pid: int
    endpoint: str
    engines: list[str]
    peer_endpoint: str = ""


class Peers(_Msg, frozen=True, tag="peers", gc=False):
    """Where each rank's worker serves its tensor store to other workers: rank -> endpoint."""

    endpoints: dict[int, str]


class StartWalk(_Msg, frozen=True, tag="walk"):
    """Run walk ``walk`` of request ``request_id`` here, loops and all. ``inputs`` and
    ``persisted`` are keyed ``"node.port"``; ``window`` is how many outputs may be in flight
    before the walk waits for :class:`WalkCredit`. With ``ranks`` empty every node of the walk
    is on this worker; otherwise the walk spans ranks (``ranks``: node -> rank), this worker
    runs its segment, the part on its own rank, and ``peers`` gives the id of the walk's
    segment on each rank, for the :class:`PeerWalks` the segments send each other."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("inputs", "params", "persisted")

    id: int
    request_id: str
    walk: str
    inputs: dict[str, Any] = {}
    params: dict[str, Any] = {}
    persisted: dict[str, Any] = {}
    window: int = 16
    ranks: dict[str, int] = {}
    peers: dict[int, int] = {}
    moves: dict[str, int] = {}


class WalkCredit(_Msg, frozen=True, tag="credit", gc=False):
    """For walks running on one worker: walk id -> outputs the conductor has taken since the
    last credit (read by the program), and the ids of walks to stop."""

    credits: dict[int, int] = {}
    cancel: list[int] = []


class FeedWalk(_Msg, frozen=True, tag="feed"):
    """Items of walk ``id``'s streamed input ``port`` (``"node.port"``), or its end
    (``end``, with no items). The worker acknowledges a feed once the input has room again
    (``WalkUpdates.fed``): one feed per input is in flight at a time."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("items",)

    id: int
    port: str
    items: Any = None
    end: bool = False


#: ``WalkUpdates`` event ports that order a split walk's outputs across ranks (no real port
#: starts with ``#``): ``UNIT_DONE`` (value: the unit) follows every output the segment made
#: before its unit finished; ``AFTER_UNIT`` (value: ``[rank, unit]``) precedes every output the
#: segment made after it learnt that unit of the segment on ``rank`` had finished.
UNIT_DONE = "#unit-done"
AFTER_UNIT = "#after-unit"
#: The ``WalkUpdates`` event port that says a walk's state moves (``StartWalk.moves``) are
#: done: from then on the walk no longer needs the ranks its state came from.
STATE_MOVED = "#state-moved"


class WalkUpdates(_Msg, frozen=True, tag="walked"):
    """What the walks on one worker made since its last such message (one per round):
    ``events`` as ``[walk id, port, value, iteration]`` (outputs, and for segments of a split
    walk the ``UNIT_DONE`` / ``AFTER_UNIT`` marks in their place), ``ended`` as ``[walk id,
    persisted]`` (values left for later walks, keyed ``"node.port"``), and walk id -> the error
    that ended it; ``fed`` lists ``[walk id, port]`` for each feed whose input has room again."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("events", "ended")

    events: list[Any] = []
    ended: list[Any] = []
    errors: dict[int, ErrorInfo] = {}
    fed: list[tuple[int, str]] = []


class PeerWalks(_Msg, frozen=True, tag="peerwalks"):
    """From rank ``rank``'s segments to this worker's, since the last such message, in order:

    - ``feeds``: ``[walk id, port, items, end, from walk]`` for each firing on a streaming edge
      into segment ``walk id``'s ``port`` (``end``: the edge has closed), or, for a plain edge,
      its final value (``end`` with ``items`` ``[value]``, or ``[]`` when none was made);
      each streaming entry is acknowledged once the consumer has room for it, as a credit of 1
      to ``from walk``, the producing segment;
    - ``credits``: walk id -> entries this rank's segments took in (credit to the producer);
    - ``blocks``: ``[walk id, unit]`` for each unit of a walk's segment on ``rank`` that has
      finished, which the segment ``walk id`` here waits for."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("feeds",)

    rank: int
    feeds: list[Any] = []
    credits: dict[int, int] = {}
    blocks: list[tuple[int, int]] = []


class Release(_Msg, frozen=True, tag="release", gc=False):
    """Forget everything held for request ``request_id`` (KV blocks, partial state)."""

    request_id: str


class Shutdown(_Msg, frozen=True, tag="shutdown", gc=False):
    """Finish and exit: the worker stops taking steps, closes its sockets and exits."""


class Ping(_Msg, frozen=True, tag="ping", gc=False):
    """Liveness probe; answered by a :class:`Pong` with the same ``id``."""

    id: int = 0


class Pong(_Msg, frozen=True, tag="pong", gc=False):
    """Answer to :class:`Ping` ``id``, with the worker's counters (e.g. ``tensors_held``,
    ``batch_sizes``: see ``mstar_async.worker.report``)."""

    id: int = 0
    stats: dict[str, Any] = {}


class FetchTensor(_Msg, frozen=True, tag="fetch", gc=False):
    """Ask a worker for the tensor it holds under ``ref_id`` (a ``TensorRef.key``); ``id``
    matches the :class:`TensorReply`."""

    ref_id: str
    id: int = 0


class TensorReply(_Msg, frozen=True, tag="tensor"):
    """Answer to :class:`FetchTensor`: the ``value`` held under ``ref_id``, or an ``error``."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("value",)

    ref_id: str
    id: int = 0
    value: Any = None
    error: ErrorInfo | None = None


class FetchState(_Msg, frozen=True, tag="fetchstate", gc=False):
    """Worker to worker: give me what engine ``engine`` holds for request ``request_id`` (its
    KV, pending tokens, sampling state), to run its next walk here; ``id`` matches the
    :class:`StateReply`. The giver keeps holding it until :class:`DropState` (or the
    request's release)."""

    request_id: str
    engine: str
    id: int = 0


class StateReply(_Msg, frozen=True, tag="state"):
    """Answer to :class:`FetchState` ``id``: the exported ``state`` (``None``: nothing held),
    or an ``error``."""

    __wire_values__: ClassVar[tuple[str, ...]] = ("state",)

    id: int
    state: Any = None
    error: ErrorInfo | None = None


class DropState(_Msg, frozen=True, tag="dropstate", gc=False):
    """Worker to worker, one way: the request's state in ``engine`` has arrived here, so the
    rank it came from frees its copy."""

    request_id: str
    engine: str


Message = (
    Hello
    | Peers
    | StartWalk
    | WalkCredit
    | FeedWalk
    | WalkUpdates
    | PeerWalks
    | Release
    | Shutdown
    | Ping
    | Pong
    | FetchTensor
    | TensorReply
    | FetchState
    | StateReply
    | DropState
)
"""Every message kind; ``decode_message`` returns one of these."""

_MESSAGE_TYPES = (
    Hello,
    Peers,
    StartWalk,
    WalkCredit,
    FeedWalk,
    WalkUpdates,
    PeerWalks,
    Release,
    Shutdown,
    Ping,
    Pong,
    FetchTensor,
    TensorReply,
    FetchState,
    StateReply,
    DropState,
)
_EXACT_TYPES = frozenset(_MESSAGE_TYPES)  # a set lookup is cheaper than isinstance over ten
register_wire_type(TensorRef, name="mstar.TensorRef")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=ext_hook())


def encode_message(msg: Message, *, shm_batch: ShmBatch | None = None) -> list[Buffer]:
    """Frame ``msg`` as ``[header, *tensor buffers]``, ready for ``send_multipart(copy=False)``.

    The tensor buffers share memory with the tensors in ``msg`` (see
    :mod:`mstar_async.transport.codec` for the cases that copy). With ``shm_batch`` (only for a
    receiver on this host), large tensors go into its shared-memory segments instead of
    frames; call ``shm_batch.cancel()`` if the message is then not sent. Synchronous, no I/O.

    Raises:
        TransportError: ``msg`` is not a message, a value in it cannot travel (the message
            names the type and how to register it), or a segment cannot be made.
    """
    if type(msg) not in _EXACT_TYPES and not isinstance(msg, _MESSAGE_TYPES):
        raise TransportError(f"encode_message: not a message: {type(msg).__qualname__}")
    buffers: list[Buffer] = []
    for name in msg.__wire_values__:
        value = getattr(msg, name)
        if value is not None:  # None encodes as itself
            wire = to_wire(value, buffers, shm_batch)
            msg = msgspec.structs.replace(msg, **{name: wire})
    try:
        header = _encoder.encode(msg)
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise TransportError(f"cannot encode {type(msg).__qualname__}: {exc}") from exc
    return [header, *buffers]


def decode_message(frames: Sequence[Buffer]) -> Message:
    """The message framed by :func:`encode_message`; its tensors share memory with ``frames``.

    Synchronous, no I/O.

    Raises:
        TransportError: no frames, a malformed or unknown header, an unregistered dataclass,
            or tensor frames that do not match the header.
    """
    if not frames:
        raise TransportError("decode_message: empty multipart message")
    return decode_wire(_decoder.decode, frames[0], frames[1:])
