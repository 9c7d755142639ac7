"""Async ZeroMQ channels: a ROUTER :class:`Server` and DEALER :class:`Link` clients.

A :class:`ZmqHub` owns one ``zmq.asyncio.Context`` and every socket opened through it, so one
``close()`` releases them all (LINGER 0: unsent messages are dropped, nothing blocks) and a
private temporary folder holds the runtime's IPC socket files, removed on close.

Event loops. ``zmq.asyncio`` watches each socket's ZMQ_FD with ``loop.add_reader`` (pyzmq >= 17);
uvloop and the default selector loop on Linux/macOS both provide it. Only the Windows proactor
loop lacks it, where pyzmq runs a selector thread of its own. A socket belongs to the loop that
first uses it: open and use a hub inside one running loop.

Endpoints. ``ipc://PATH`` for processes on one host (``hub.ipc_endpoint()`` makes a unique one,
in a folder only this user can enter), ``tcp://HOST:PORT`` across hosts; port ``0`` (or ``*``)
binds a free port, and :attr:`Server.endpoint` reports the one bound.

Security. A TCP socket opened with CURVE keys (``curve=`` on :meth:`ZmqHub.bind` /
:meth:`ZmqHub.connect`; see :mod:`~mstar_async.transport.secure`) is authenticated and
encrypted: the server admits only the client keys it names, the client talks only to the
server holding the key it names. Without keys, a TCP socket binds loopback addresses only.
IPC sockets need no keys and ignore them: their files sit in the hub's private folder.

High-water marks. Both sides default to ``hwm=0``, no limit: a full ROUTER pipe would otherwise
drop messages silently, and flow control belongs to the conductor, which bounds the steps it has
in flight per worker. The ROUTER sets ROUTER_MANDATORY, so a send to a peer that is not connected
raises :class:`TransportError` instead of vanishing. Pass ``hwm=N`` to cap queued messages per
peer; a DEALER send then waits while its queue is full.

Shared memory. Sockets on ``ipc://`` endpoints (so both ends are on this host) send tensors of
at least :data:`~mstar_async.transport.shm.SHM_TENSOR_BYTES` through shared memory by default:
the bytes are copied once into a segment of the hub's :class:`~mstar_async.transport.shm.
SegmentPool` and the message carries its name, instead of being copied into the kernel's
socket buffer and out again. ``shared_memory=False`` on :meth:`ZmqHub.bind` /
:meth:`ZmqHub.connect` turns it off; TCP sockets never use it. Receiving needs nothing: any
socket decodes such a message, as long as the sending hub is still open (its ``close()``
unlinks the segments).

Copies. Messages go out with ``copy=False``: frames of 64 KiB or more (``zmq.COPY_THRESHOLD``)
are handed to libzmq by reference (a tensor must not be modified until it is sent), smaller ones
are copied by pyzmq, which is cheaper for them. Received frames are ``zmq.Frame`` objects that
own libzmq's buffer; decoded tensors point into them and keep them alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Sequence
from functools import partial
from types import TracebackType
from typing import Self, TypeVar, cast

import zmq
import zmq.asyncio

from mstar_async.logs import get_logger
from mstar_async.transport import shm
from mstar_async.transport.codec import Buffer
from mstar_async.transport.curve import CurveClient, CurveServer
from mstar_async.transport.errors import TransportError
from mstar_async.transport.secure import Gate, check_listen, secure_client, secure_server
from mstar_async.transport.wire import Message, decode_message, encode_message

log = get_logger("mstar_async.transport.zmq_link")

__all__ = ["Link", "Server", "ZmqHub"]

_S = TypeVar("_S", bound="_Socket")

# sun_path holds 108 bytes including the terminating NUL on Linux (104 on macOS).
_IPC_PATH_MAX = 103


class _Socket:
    """What Link and Server share: send/recv futures, cancel-safe receive, close."""

    def __init__(
        self,
        hub: ZmqHub,
        sock: zmq.asyncio.Socket,
        endpoint: str,
        pool: shm.SegmentPool | None = None,
    ) -> None:
        self._hub = hub
        self._sock = sock
        self._endpoint = endpoint
        self._pool = pool
        self._pending: asyncio.Future[list[zmq.Frame]] | None = None
        self._receiving = False
        self._closed = False

    @property
    def endpoint(self) -> str:
        """The endpoint bound or connected to (a bound TCP port 0 replaced by the real one)."""
        return self._endpoint

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def shared_memory(self) -> bool:
        """Whether this socket sends large tensors through shared memory."""
        return self._pool is not None

    def _encode(self, msg: Message) -> tuple[list[Buffer], shm.ShmBatch | None]:
        if self._pool is None:
            return encode_message(msg), None
        batch = self._pool.batch()
        try:
            return encode_message(msg, shm_batch=batch), batch
        except BaseException:
            batch.cancel()
            raise

    async def _send_parts(self, parts: Sequence[Buffer], batch: shm.ShmBatch | None = None) -> None:
        future: asyncio.Future[object] | None = None
        try:
            future = self._start_send(parts)
            # pyzmq sends at once when the queue has room and returns a finished future; only a
            # full queue (hwm > 0) makes us wait.
            if not future.done():
                await future
            future.result()
        except zmq.ZMQError as exc:
            raise self._send_error(parts, exc) from exc
        finally:
            # A message that did not go out frees its segments; one that did leaves them to
            # the receiver (a cancel that lands after the send finished must not free them).
            if batch is not None and not _sent(future):
                batch.cancel()

    def _start_send(self, parts: Sequence[Buffer]) -> asyncio.Future[object]:
        if self._closed:
            raise TransportError(f"send on a closed socket ({self._endpoint})")
        # One frame (a small message from a Link) skips send_multipart's per-frame loop.
        sent = (
            self._sock.send(parts[0], copy=False)
            if len(parts) == 1
            else self._sock.send_multipart(parts, copy=False)
        )
        return cast("asyncio.Future[object]", sent)

    def _send_error(self, parts: Sequence[Buffer], exc: zmq.ZMQError) -> TransportError:
        if exc.errno == zmq.EHOSTUNREACH:
            return TransportError(f"no peer {bytes(parts[0])!r} connected to {self._endpoint}")
        return TransportError(f"send failed on {self._endpoint}: {exc}")

    async def _recv_parts(self) -> list[zmq.Frame]:
        if self._closed:
            raise TransportError(f"recv on a closed socket ({self._endpoint})")
        if self._receiving:
            # Two readers would both be handed the one pending message.
            raise TransportError(
                f"concurrent recv on {self._endpoint}: use one reader task per socket"
            )
        # Cancel safety: the receive future is kept until its message is taken, so a message
        # that arrives just as its reader is cancelled goes to the next reader instead of being
        # lost. A cancel that lands before the message arrived cancels pyzmq's future, and
        # pyzmq then leaves the message in the socket. Awaiting the future directly (no
        # asyncio.shield) saves an event loop hop per message.
        future = self._pending
        if future is None:
            future = cast("asyncio.Future[list[zmq.Frame]]", self._sock.recv_multipart(copy=False))
            self._pending = future
        if not future.done():
            self._receiving = True
            try:
                await future
            except asyncio.CancelledError:
                if not future.cancelled():
                    raise  # the message arrived: it stays pending for the next reader
                self._pending = None
                task = asyncio.current_task()
                if self._closed and task and not task.cancelling():
                    raise TransportError(
                        f"socket closed while receiving ({self._endpoint})"
                    ) from None
                raise
            except zmq.ZMQError:
                pass  # raised below as a TransportError
            finally:
                self._receiving = False
        self._pending = None
        try:
            return future.result()
        except asyncio.CancelledError:
            raise TransportError(f"socket closed while receiving ({self._endpoint})") from None
        except zmq.ZMQError as exc:
            raise TransportError(f"recv failed on {self._endpoint}: {exc}") from exc

    def close(self) -> None:
        """Close the socket at once (LINGER 0: queued outgoing messages are dropped).

        A pending :meth:`recv` then raises :class:`TransportError`. Idempotent; never raises.
        """
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._hub._forget(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Link(_Socket):
    """The DEALER side: a worker's (or the conductor's) connection to one :class:`Server`.

    Messages are delivered in order; :meth:`recv` returns whatever the server sent to this
    link's identity. Open one with :meth:`ZmqHub.connect`.
    """

    async def send(self, msg: Message) -> None:
        """Encode and send ``msg``.

        Cancel-safe: a message goes out whole or not at all (a send cancelled while waiting
        for room is not sent).

        Raises:
            TransportError: the link is closed, ``msg`` holds a value that cannot travel, or
                a shared-memory segment cannot be made (``/dev/shm`` full).
        """
        parts, batch = self._encode(msg)
        await self._send_parts(parts, batch)

    def send_nowait(self, msg: Message) -> None:
        """Encode and send ``msg`` from synchronous code: at once when the socket has room
        (always, at the default ``hwm=0``), else after the messages queued before it, in order.
        A send that fails once queued frees the message's shared memory and is logged; the
        link's next ``send`` or ``recv`` meets the same fault.

        Raises:
            TransportError: the link is closed, ``msg`` holds a value that cannot travel, or
                the send failed at once.
        """
        parts, batch = self._encode(msg)
        try:
            future = self._start_send(parts)
        except BaseException:
            if batch is not None:
                batch.cancel()
            raise
        if future.done():
            _settle_send(future, batch, parts, self, late=False)
        else:
            future.add_done_callback(
                partial(_settle_send, batch=batch, parts=parts, sock=self, late=True)
            )

    async def send_frames(self, frames: Sequence[Buffer]) -> None:
        """Send already-framed parts (``encode_message`` output, or raw bytes for benchmarks).

        Cancel-safe as :meth:`send`.

        Raises:
            TransportError: the link is closed.
        """
        await self._send_parts(frames)

    async def recv(self) -> Message:
        """Wait for the next message and decode it; its tensors point into the received frames.

        Cancel-safe: a cancelled ``recv`` loses no message (the next call gets it). One reader
        at a time: run one receive loop per socket.

        Raises:
            TransportError: the link is (or gets) closed, another ``recv`` is waiting, or the
                message is malformed (it is consumed).
        """
        return decode_message(await self._recv_parts())

    async def recv_frames(self) -> list[zmq.Frame]:
        """Wait for the next message and return its frames undecoded.

        Cancel-safe and one reader at a time, as :meth:`recv`.

        Raises:
            TransportError: the link is (or gets) closed, or another ``recv`` is waiting.
        """
        return await self._recv_parts()


class Server(_Socket):
    """The ROUTER side: receives from many :class:`Link` peers and answers each by identity.

    Open one with :meth:`ZmqHub.bind`.
    """

    async def send(self, identity: bytes, msg: Message) -> None:
        """Encode ``msg`` and send it to the peer ``identity`` (as :meth:`recv` returned it).

        Cancel-safe: whole or not at all.

        Raises:
            TransportError: the server is closed, no peer ``identity`` is connected, ``msg``
                holds a value that cannot travel, or a shared-memory segment cannot be made.
        """
        parts, batch = self._encode(msg)
        await self._send_parts([identity, *parts], batch)

    async def send_frames(self, identity: bytes, frames: Sequence[Buffer]) -> None:
        """Send already-framed parts to ``identity``. Cancel-safe; raises as :meth:`send`."""
        await self._send_parts([identity, *frames])

    async def recv(self) -> tuple[bytes, Message]:
        """Wait for the next message from any peer: ``(identity, message)``.

        Cancel-safe: a cancelled ``recv`` loses no message. One reader at a time: run one
        receive loop per socket.

        Raises:
            TransportError: the server is (or gets) closed, another ``recv`` is waiting, or the
                message is malformed (it is consumed).
        """
        identity, frames = await self.recv_frames()
        return identity, decode_message(frames)

    async def recv_frames(self) -> tuple[bytes, list[zmq.Frame]]:
        """Wait for the next message: ``(identity, frames)`` undecoded.

        Cancel-safe and one reader at a time, as :meth:`recv`.

        Raises:
            TransportError: the server is (or gets) closed, another ``recv`` is waiting, or a
                message without an identity frame.
        """
        parts = await self._recv_parts()
        if len(parts) < 2:
            raise TransportError(f"message without identity frame on {self._endpoint}")
        return parts[0].bytes, parts[1:]


class ZmqHub:
    """One runtime's ZeroMQ context, its sockets and its IPC folder; ``close()`` ends them all.

    Use it as a context manager (``with ZmqHub() as hub:``) or call :meth:`close`. Opening
    sockets is synchronous (ZeroMQ connects in the background); do it inside the event loop
    that will use them.

    Args:
        io_threads: libzmq I/O threads; one moves about a GB/s, enough for one host.
    """

    def __init__(self, *, io_threads: int = 1) -> None:
        self._ctx = zmq.asyncio.Context(io_threads=io_threads)
        self._sockets: set[_Socket] = set()
        self._pool: shm.SegmentPool | None = None
        self._ipc_dir: str | None = None
        self._names = itertools.count()
        self._gate: Gate | None = None
        self._closed = False

    @property
    def open_sockets(self) -> int:
        """How many sockets opened through this hub are not closed yet."""
        return len(self._sockets)

    def ipc_endpoint(self, name: str | None = None) -> str:
        """A fresh ``ipc://`` endpoint in this hub's private folder (removed by :meth:`close`).

        Raises:
            TransportError: the hub is closed, or the path is too long for a unix socket.
        """
        self._check_open()
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="mstar-")
        path = os.path.join(self._ipc_dir, name or f"s{next(self._names)}")
        if len(path.encode()) > _IPC_PATH_MAX:
            raise TransportError(f"IPC path too long for a unix socket ({len(path)} bytes): {path}")
        return f"ipc://{path}"

    def bind(
        self,
        endpoint: str | None = None,
        *,
        hwm: int = 0,
        shared_memory: bool | None = None,
        curve: CurveServer | None = None,
    ) -> Server:
        """Open a ROUTER :class:`Server` bound to ``endpoint`` (default: a fresh IPC endpoint).

        ``tcp://HOST:0`` binds a free port; read it back from :attr:`Server.endpoint`.
        ``shared_memory``: send large tensors through shared memory (default: on for ``ipc://``
        endpoints where ``/dev/shm`` exists; see the module notes). ``curve``: on a TCP
        endpoint, admit only the clients it names, encrypted; without it, TCP binds loopback
        addresses only. IPC endpoints ignore it.

        Raises:
            TransportError: the hub is closed, the endpoint cannot be bound (in use,
                malformed), TCP without ``curve`` on an address that is not loopback, or
                ``shared_memory=True`` on an endpoint that is not ``ipc://``.
        """
        self._check_open()
        target = self.ipc_endpoint() if endpoint is None else endpoint
        pool = self._pool_for(target, shared_memory)
        secured = curve if target.startswith("tcp://") else None
        if secured is None:
            check_listen(target)
        else:
            # The gate knows the socket's clients before the socket can take a connection.
            domain = f"mstar-{next(self._names)}"
            self._gate_up().admit(domain, secured.clients)
        sock = self._socket(zmq.ROUTER, hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if secured is not None:
            secure_server(sock, secured, domain)
        try:
            sock.bind(target)
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot bind {target}: {exc}") from exc
        return self._keep(Server(self, sock, bound, pool))

    def connect(
        self,
        endpoint: str,
        *,
        identity: bytes | None = None,
        hwm: int = 0,
        shared_memory: bool | None = None,
        curve: CurveClient | None = None,
    ) -> Link:
        """Open a DEALER :class:`Link` to ``endpoint``; messages queue until the peer is up.

        ``identity`` is what the server sees as this link's identity (default: one libzmq
        picks); give it when the server must address a known peer, e.g. ``b"rank-3"``.
        ``shared_memory`` as for :meth:`bind`. ``curve``: on a TCP endpoint, talk only to the
        server holding the key it names, encrypted (nothing is delivered until the handshake
        succeeds); IPC endpoints ignore it.

        Raises:
            TransportError: the hub is closed, the endpoint is malformed, or
                ``shared_memory=True`` on an endpoint that is not ``ipc://``.
        """
        self._check_open()
        pool = self._pool_for(endpoint, shared_memory)
        sock = self._socket(zmq.DEALER, hwm)
        if curve is not None and endpoint.startswith("tcp://"):
            secure_client(sock, curve)
        try:
            if identity is not None:
                sock.setsockopt(zmq.ROUTING_ID, identity)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint}: {exc}") from exc
        return self._keep(Link(self, sock, endpoint, pool))

    def close(self) -> None:
        """Close every socket of this hub, end its context and remove its IPC folder.

        Pending receives raise :class:`TransportError`. Idempotent; never raises.
        """
        if self._closed:
            return
        self._closed = True
        if self._gate is not None:
            self._gate.close()
        for sock in list(self._sockets):
            sock.close()
        self._ctx.term()
        if self._pool is not None:
            self._pool.close()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> ZmqHub:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _gate_up(self) -> Gate:
        if self._gate is None:
            self._gate = Gate(self._ctx)
        return self._gate

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("ZmqHub is closed")

    def _pool_for(self, endpoint: str, shared_memory: bool | None) -> shm.SegmentPool | None:
        ipc = endpoint.startswith("ipc://")
        if shared_memory is None:
            shared_memory = ipc and shm.available()
        elif shared_memory and not ipc:
            raise TransportError(
                f"shared_memory=True needs an ipc:// endpoint (both ends on this host), not "
                f"{endpoint}; leave shared_memory unset for TCP"
            )
        if not shared_memory:
            return None
        if self._pool is None:
            self._pool = shm.SegmentPool()
        return self._pool

    def _socket(self, kind: int, hwm: int) -> zmq.asyncio.Socket:
        sock: zmq.asyncio.Socket = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        return sock

    def _keep(self, sock: _S) -> _S:
        self._sockets.add(sock)
        return sock

    def _forget(self, sock: _Socket) -> None:
        with contextlib.suppress(KeyError):
            self._sockets.remove(sock)


def _settle_send(
    future: asyncio.Future[object],
    batch: shm.ShmBatch | None,
    parts: Sequence[Buffer],
    sock: _Socket,
    *,
    late: bool,
) -> None:
    """After ``send_nowait``'s send: a message that did not go out frees its segments, and its
    fault is raised (``late``: it was queued, so the fault is logged instead)."""
    if _sent(future):
        return
    if batch is not None:
        batch.cancel()
    error = None if future.cancelled() else future.exception()
    fault = sock._send_error(parts, error) if isinstance(error, zmq.ZMQError) else error
    if fault is None:
        return
    if late:
        log.warning("transport.send_failed", endpoint=sock.endpoint, error=str(fault))
        return
    raise fault


def _sent(future: asyncio.Future[object] | None) -> bool:
    return (
        future is not None
        and future.done()
        and not future.cancelled()
        and future.exception() is None
    )
