"""How a worker reaches other workers: its store served on a ROUTER, peers' tensors fetched over
DEALER links, and over the same sockets the traffic of walks that span ranks (``PeerWalks``)
and requests' engine state moving between ranks (``FetchState`` / ``DropState``).

Each worker binds one peer endpoint (IPC when the conductor is on this host, TCP otherwise) and
says it in ``Hello``; the conductor sends every worker the map of them (``Peers``) whenever a
rank comes up. A worker opens a link to a peer on its first fetch from it, and replaces it when
the peer's endpoint changes (the peer restarted), which fails any fetch still waiting on the old
one. Fetches to one peer take turns on its link; each waits at most :data:`FETCH_TIMEOUT`.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import anyio
import torch

from mstar_async.errors import TensorNotHeld
from mstar_async.logs import get_logger
from mstar_async.transport import (
    CurveKeys,
    DropState,
    ErrorInfo,
    FetchState,
    FetchTensor,
    Link,
    PeerWalks,
    Server,
    StateReply,
    TensorRef,
    TensorReply,
    TransportError,
    ZmqHub,
)
from mstar_async.transport.secure import is_loopback
from mstar_async.worker.tensor_store import TensorStore

__all__ = ["FETCH_TIMEOUT", "WorkerTensors", "bind_peer_endpoint"]

#: Seconds a fetch from another worker may take before it fails the step that needed it.
FETCH_TIMEOUT = 60.0

log = get_logger("mstar_async.worker.tensors")


def bind_peer_endpoint(
    hub: ZmqHub, conductor_endpoint: str, keys: CurveKeys | None = None
) -> tuple[Server, str]:
    """Bind this worker's peer server and return it with the endpoint peers should dial.

    IPC when the conductor is reached over IPC (all workers on one host), else TCP advertised
    under the address this host uses to reach the conductor: on every interface with CURVE
    ``keys`` (peers present the worker key) unless that address is loopback, on that address
    alone otherwise (without keys it must be loopback: the conductor, and so every peer, is on
    this host then).

    Raises:
        TransportError: the endpoint cannot be bound, or it is not loopback and there are no
            ``keys``.
    """
    if conductor_endpoint.startswith("ipc://"):
        server = hub.bind()
        return server, server.endpoint
    local = _local_address(conductor_endpoint)
    if keys is None or is_loopback(local):
        server = hub.bind(f"tcp://{local}:0", curve=None if keys is None else keys.peer_server())
    else:
        server = hub.bind("tcp://0.0.0.0:0", curve=keys.peer_server())
    port = server.endpoint.rsplit(":", 1)[1]
    return server, f"tcp://{local}:{port}"


def _local_address(endpoint: str) -> str:
    # The interface the kernel routes towards the conductor is one peers can reach too; a UDP
    # connect sends nothing, it only picks the route.
    host = urlsplit(endpoint).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
        except OSError:
            return host


class _Peer:
    __slots__ = ("endpoint", "link", "lock")

    def __init__(self, endpoint: str, link: Link) -> None:
        self.endpoint = endpoint
        self.link = link
        self.lock = anyio.Lock()


class WorkerTensors:
    """One worker's store, its peer links, and the two steps around each forward.

    ``fetch`` brings a handle's tensor here; ``ask`` puts a question to a peer; ``answer``
    serves a ``FetchTensor``; ``serve`` answers peers.
    With CURVE ``keys``, links to peers over TCP present the worker key and trust only it.

    Raises:
        TransportError: ``keys`` lack the worker's secret key.
    """

    def __init__(self, hub: ZmqHub, store: TensorStore, keys: CurveKeys | None = None) -> None:
        self.hub = hub
        self.store = store
        self._curve = keys.peer_client() if keys is not None else None
        self._endpoints: dict[int, str] = {}
        self._peers: dict[int, _Peer] = {}
        self._ids = itertools.count()
        self.fetched = 0  # tensors fetched from other workers
        self.served = 0  # tensors sent to other workers or the conductor

    def stats(self) -> dict[str, int]:
        """The store's counters plus ``tensors_fetched`` and ``tensors_served``."""
        return {
            **self.store.stats(),
            "tensors_fetched": self.fetched,
            "tensors_served": self.served,
        }

    def knows(self, rank: int) -> bool:
        """Whether this worker has been told where ``rank`` listens."""
        return bool(self._endpoints.get(rank))

    async def send(self, rank: int, message: PeerWalks | DropState) -> None:
        """Send ``message`` to ``rank``'s worker (one-way: nothing answers it).

        Raises:
            TransportError: the rank's endpoint is unknown, or the link is closed.
        """
        await self._peer(rank).link.send(message)

    def set_peers(self, endpoints: Mapping[int, str]) -> None:
        """Learn where each rank serves its tensors; links to a peer that moved are closed (a
        fetch waiting on one fails). Never raises."""
        self._endpoints = dict(endpoints)
        for rank, peer in list(self._peers.items()):
            if self._endpoints.get(rank) != peer.endpoint:
                peer.link.close()
                del self._peers[rank]

    async def fetch(self, ref: TensorRef) -> torch.Tensor:
        """The tensor behind ``ref``: from this worker's store (the same object, no copy) or
        fetched from the rank that holds it. Cancel-safe.

        Raises:
            TensorNotHeld: its tensor is gone (its request released, its worker restarted).
            TransportError: the holder is unknown, unreachable within :data:`FETCH_TIMEOUT`, or
                restarted during the fetch.
        """
        if ref.rank == self.store.rank:
            return self.store.get(ref)
        question = FetchTensor(ref.key, self.next_id())
        reply = await self.ask(ref.rank, question, f"tensor {ref.key!r}")
        assert isinstance(reply, TensorReply)
        if reply.error is not None:
            raise reply.error.to_exception()
        value = reply.value
        if not isinstance(value, torch.Tensor):
            raise TransportError(f"rank {ref.rank} answered {ref.key!r} with no tensor")
        self.fetched += 1
        return value

    def next_id(self) -> int:
        """A fresh id for a question to a peer (see :meth:`ask`)."""
        return next(self._ids)

    async def ask(
        self, rank: int, question: FetchTensor | FetchState, what: str
    ) -> TensorReply | StateReply:
        """Send ``question`` to ``rank``'s worker and return the reply with its id (``what``
        names it in errors). Questions to one peer take turns on its link. Cancel-safe: a
        cancelled question's reply is skipped by the next one on that link.

        Raises:
            TransportError: the rank is unknown, unreachable within :data:`FETCH_TIMEOUT`, or
                restarted meanwhile.
        """
        peer = self._peer(rank)
        kind = TensorReply if isinstance(question, FetchTensor) else StateReply
        try:
            with anyio.fail_after(FETCH_TIMEOUT):
                async with peer.lock:
                    await peer.link.send(question)
                    while True:
                        reply = await peer.link.recv()
                        # A reply to a question that was cancelled after sending: not ours.
                        if isinstance(reply, kind) and reply.id == question.id:
                            return reply
        except TimeoutError:
            raise TransportError(
                f"rank {self.store.rank}: fetching {what} from rank {rank} "
                f"({peer.endpoint}) took over {FETCH_TIMEOUT} s"
            ) from None

    def _peer(self, rank: int) -> _Peer:
        peer = self._peers.get(rank)
        if peer is None:
            endpoint = self._endpoints.get(rank)
            if not endpoint:
                raise TransportError(
                    f"rank {self.store.rank} knows no endpoint for rank {rank}; ranks known: "
                    f"{sorted(self._endpoints)}"
                )
            link = self.hub.connect(endpoint, curve=self._curve)
            peer = self._peers[rank] = _Peer(endpoint, link)
        return peer

    def answer(self, fetch: FetchTensor) -> TensorReply:
        """The reply to ``fetch``: the tensor (sent from this worker's memory), or the error.
        Never raises."""
        ref = TensorRef(self.store.rank, fetch.ref_id, (), "")
        try:
            tensor = self.store.get(ref)
            self.served += 1
            return TensorReply(fetch.ref_id, fetch.id, tensor)
        except TensorNotHeld as exc:
            return TensorReply(fetch.ref_id, fetch.id, error=ErrorInfo.from_exception(exc))

    async def serve(
        self, server: Server, walks: Callable[[PeerWalks], None], states: StateGiver
    ) -> None:
        """Answer other workers' fetches, hand their ``PeerWalks`` to ``walks``, and their
        state moves to ``states`` (each answered by a task of its own: an export waits for a
        gap between forwards), until cancelled. Cancel-safe."""
        async with anyio.create_task_group() as tasks:
            while True:
                try:
                    peer, message = await server.recv()  # a malformed message is skipped
                except TransportError as exc:
                    if server.closed:
                        return
                    log.warning("tensors.bad_message", error=str(exc))
                    continue
                if isinstance(message, FetchTensor):
                    await server.send(peer, self.answer(message))
                elif isinstance(message, PeerWalks):
                    walks(message)
                elif isinstance(message, FetchState):
                    tasks.start_soon(_give_state, server, peer, states, message)
                elif isinstance(message, DropState):
                    tasks.start_soon(states.drop, message)


class StateGiver(Protocol):
    """What answers other workers' state moves (``mstar_async.worker.state_moves``)."""

    async def give(self, question: FetchState) -> StateReply:
        """The request's exported state (kept here until ``drop``). Never raises."""
        ...

    async def drop(self, message: DropState) -> None:
        """Free the request's state in that engine here. Never raises."""
        ...


async def _give_state(
    server: Server, peer: bytes, states: StateGiver, question: FetchState
) -> None:
    reply = await states.give(question)
    try:
        await server.send(peer, reply)
    except TransportError as exc:  # the asker is gone: the request's release frees the state
        log.warning("tensors.state_unsent", request=question.request_id, error=str(exc))
