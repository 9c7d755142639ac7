"""``RemoteLauncher``: worker ranks that join over plain TCP from other hosts, without Ray.

Nothing is started on the other hosts by this process: a user (or their supervisor: systemd,
a container, a job script) runs ``mstar worker --conductor tcp://HOST:PORT --rank N`` there,
and the worker joins the runtime that listens at that address. Who binds and who connects:
the conductor's side binds, workers connect. The conductor's address is the one thing every
worker needs anyway (steps and replies go through the conductor), ZeroMQ reconnects on its own
so a worker may be started before or after the runtime opens, and the worker hosts need no
open port at all.

Two sockets on the conductor's host: the launcher's control socket at ``listen`` (joins and
heartbeats, see ``mstar_async.worker.control``) and the pool's step socket at ``data_port``
(default: the next port), which the worker dials at the host it reached the launcher at.

With CURVE keys (``curve_keys``) both sockets, and the workers' peer sockets, admit only
workers holding the worker key, and workers talk only to a runtime holding the runtime key;
without keys both listen on a loopback address only (workers on this host).

A remote worker that dies (or whose host or network does) is seen when its heartbeats stop:
its walks fail with ``WorkerLost`` naming the rank. It is not restarted (this process
did not start it and cannot start it again), so the rank stays down until the runtime is
reopened. A worker whose conductor goes away hears no heartbeat answers and exits after the
same timeout: across hosts there is no parent-death signal to rely on.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import anyio
import zmq

from mstar_async.errors import MstarError, WorkerLost
from mstar_async.logs import get_logger
from mstar_async.placement import Placement
from mstar_async.transport import CurveKeys, CurveServer
from mstar_async.transport.secure import Gate, check_listen, secure_server
from mstar_async.worker.control import (
    PROTOCOL,
    Beat,
    Bye,
    ControlMessage,
    Join,
    Refuse,
    Stop,
    Welcome,
    decode_control,
    encode_control,
    is_this_host,
    split_tcp,
)
from mstar_async.worker.launchers import KILLED, Launcher, LocalLauncher, WorkerHandle
from mstar_async.worker.main import WorkerConfig

__all__ = ["DEFAULT_PORT", "LOST", "RemoteLauncher", "RemoteWorker"]

log = get_logger("mstar_async.worker.remote")

#: The port ``RemoteLauncher`` listens on by default (the step socket takes the next one).
DEFAULT_PORT = 5555

#: The exit code reported for a remote worker whose end was not reported (heartbeats stopped,
#: or it never joined): its real status is on its own host.
LOST = -1

_POLL_MS = 50
_WAIT_POLL_S = 0.05
_CONTROL_DOMAIN = "mstar-control"


class RemoteWorker:
    """A rank served by a worker on another host, as the pool sees it: pending until a worker
    joins as that rank, then alive while its heartbeats come, then ended.

    ``detail`` says what it waits for, or why it ended.
    """

    def __init__(self, config: WorkerConfig, command: str, host: str | None) -> None:
        self.config = config
        self.command = command
        self.host = host
        self.nonce: str | None = None
        self.identity: bytes | None = None
        self.peer = ""
        self._pid: int | None = None
        self._returncode: int | None = None
        self.last_seen = 0.0
        self.detail = f"waiting for a worker to join: run `{command}` on {host or 'its host'}"
        self._kill = threading.Event()

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def pid(self) -> int | None:
        """The worker's pid on its own host; None until it joins."""
        return self._pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once ended (``LOST`` when it stopped answering); None meanwhile."""
        return self._returncode

    @property
    def joined(self) -> bool:
        return self.nonce is not None

    def end(self, code: int, detail: str) -> None:
        """Mark the worker ended (first call wins). Never raises."""
        if self._returncode is None:
            self.detail = detail
            self._returncode = code

    async def wait(self) -> int:
        """Return the exit status once the worker has ended. Cancel-safe; never raises."""
        # The control thread updates the state: poll it rather than cross threads to wake us.
        while self._returncode is None:  # noqa: ASYNC110
            await anyio.sleep(_WAIT_POLL_S)
        return self._returncode

    def kill(self) -> None:
        """Tell the worker to exit now (best effort: its host may be unreachable) and stop
        waiting for it. Idempotent; never raises."""
        if self._returncode is None:
            self._kill.set()
            self.end(KILLED, "killed by the runtime (told to exit)")


class RemoteLauncher:
    """Worker ranks that join over TCP (``mstar worker``) instead of being started here.

    ``listen`` is where this launcher waits for joins (``tcp://HOST:PORT``; port 0 picks a free
    one, read back from ``address`` after ``open``); ``ranks`` are the ranks that join (None:
    every rank); the others are started by ``local`` (default ``LocalLauncher``, child
    processes, which then reach the pool over TCP on loopback). ``hosts`` names each remote
    rank's host, for messages and to warn when a worker joins from elsewhere
    (``for_placement`` fills both from a placement's ``hosts:``).

    ``data_port`` is the pool's step socket (default: the ``listen`` port + 1, or a free one
    when that is 0); ``data_host`` is where remote workers dial it (default: the host they
    reached ``listen`` at). Open both ports to the worker hosts.

    ``curve_keys`` authenticate and encrypt both sockets (the runtime's secret key and the
    workers' public key; local ranks, which dial the pool over TCP too, also need the worker's
    secret key). Without keys, ``listen`` must be a loopback address.

    A worker beats every ``heartbeat`` seconds; either side that hears nothing for
    ``timeout`` seconds takes the other for gone. A rank nobody joins within ``join_timeout``
    seconds fails the runtime's start with ``WorkerLost`` naming it.

    Raises:
        ValueError: a non-positive timing, ``timeout`` not above ``heartbeat``, or a negative
            rank.
        MstarError: ``listen`` is not a TCP address.
        TransportError: ``curve_keys`` lack the runtime's secret key.
    """

    def __init__(
        self,
        listen: str = f"tcp://0.0.0.0:{DEFAULT_PORT}",
        *,
        ranks: Iterable[int] | None = None,
        hosts: Mapping[int, str] | None = None,
        data_port: int | None = None,
        data_host: str | None = None,
        heartbeat: float = 0.5,
        timeout: float = 5.0,
        join_timeout: float = 120.0,
        local: Launcher | None = None,
        curve_keys: CurveKeys | None = None,
    ) -> None:
        self.listen_host, self.listen_port = split_tcp(listen)
        self.curve_keys = curve_keys
        self._curve: CurveServer | None = curve_keys.runtime_server() if curve_keys else None
        self.ranks = None if ranks is None else frozenset(ranks)
        self.hosts = dict(hosts or {})
        self.data_port = data_port
        self.data_host = data_host
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.local: Launcher = local if local is not None else LocalLauncher()
        if min(heartbeat, timeout, join_timeout) <= 0:
            raise ValueError("heartbeat, timeout and join_timeout must be > 0")
        if timeout <= heartbeat:
            raise ValueError(f"timeout ({timeout} s) must be longer than heartbeat ({heartbeat} s)")
        if any(rank < 0 for rank in self.ranks or ()):
            raise ValueError(f"ranks must be >= 0, got {sorted(self.ranks or ())}")
        self.address = ""
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._gate: Gate | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[int, RemoteWorker] = {}
        self._outbox: collections.deque[tuple[bytes, ControlMessage]] = collections.deque()
        self._local_opened = False
        self._port = 0
        self._data_port = 0

    @classmethod
    def for_placement(
        cls, placement: Placement, listen: str = f"tcp://0.0.0.0:{DEFAULT_PORT}", **options: Any
    ) -> RemoteLauncher:
        """A launcher whose remote ranks are those ``placement.hosts`` puts on another host;
        ranks without a host, or on this one, run as local child processes. ``options`` go to
        the constructor.

        Raises:
            as the constructor.
        """
        remote = {rank: host for rank, host in placement.hosts.items() if not is_this_host(host)}
        return cls(listen, ranks=remote, hosts=remote, **options)

    def is_remote(self, rank: int) -> bool:
        """Whether ``rank`` joins over TCP rather than being started here. Never raises."""
        return self.ranks is None or rank in self.ranks

    def command(self, rank: int) -> str:
        """The command that serves ``rank`` from another host. Never raises."""
        host = self.listen_host
        if host in ("0.0.0.0", "*", "[::]"):
            host = socket.gethostname()  # listening everywhere: name the host itself
        port = self._port or self.listen_port
        keys = f" --curve-keys {self.curve_keys.folder}" if self.curve_keys else ""
        return f"mstar worker --conductor tcp://{host}:{port} --rank {rank}{keys}"

    # ------------------------------------------------------------------ Launcher

    async def open(self) -> str:
        """Listen for joins and return the pool's step endpoint (``tcp://127.0.0.1:PORT``, or
        ``127.0.0.1`` for a free port: local ranks dial it on loopback, remote ones at the host
        they joined through). Returns at once; workers join as the pool starts their ranks.

        Raises:
            MstarError: ``listen`` cannot be bound (in use, not an address of this host), or
                is not loopback and there are no ``curve_keys`` (a ``TransportError``).
        """
        if self._thread is not None:
            raise MstarError("RemoteLauncher serves one runtime at a time; it is already open")
        self._workers = {}  # a launcher reopened for another runtime starts afresh
        self._outbox.clear()
        endpoint = f"tcp://{self.listen_host}:{self.listen_port}"
        if self._curve is None:
            check_listen(endpoint)
        self._ctx = zmq.Context()
        if self._curve is not None:
            # The gate knows who may join before the socket can take a connection.
            self._gate = Gate(self._ctx)
            self._gate.admit(_CONTROL_DOMAIN, self._curve.clients)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve is not None:
            secure_server(sock, self._curve, _CONTROL_DOMAIN)
        try:
            bound = sock.bind(endpoint)
            port = int(bound.addr.rsplit(":", 1)[1])
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._close_context()
            raise MstarError(
                f"cannot listen for remote workers on {endpoint}: {exc}; pick another port "
                "(RemoteLauncher(listen=...))"
            ) from exc
        self._sock = sock
        self.address = f"tcp://{self.listen_host}:{port}"
        self._port = port
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, name="mstar-remote-control")
        self._thread.start()
        try:
            await self.local.open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        self._local_opened = True
        default = port + 1 if port else 0
        self._data_port = self.data_port if self.data_port is not None else default
        log.info("remote.listen", address=self.address, data_port=self._data_port)
        return f"tcp://127.0.0.1:{self._data_port}" if self._data_port else "127.0.0.1"

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        """Start a local rank with ``local``; for a remote rank, return a handle that waits
        for a worker to join as it (the pool then waits for its ``Hello``).

        Raises:
            WorkerLost: a remote rank is asked for again after its worker was lost: this
                process cannot restart a worker it did not start.
            Whatever ``local.start`` raises, for a local rank.
        """
        if not self.is_remote(config.rank):
            return await self.local.start(config)
        host = self.hosts.get(config.rank)
        if config.generation > 1:
            raise WorkerLost(
                f"worker rank {config.rank} is a remote worker (it joined over TCP; this "
                "process did not start it), so it is not restarted: the rank stays down. Run "
                f"`{self.command(config.rank)}` on {host or 'its host'} again and reopen the "
                "runtime"
            )
        # A remote worker has no parent here to watch (0 turns the watchdog off); it exits
        # when heartbeats stop instead.
        worker = RemoteWorker(replace(config, parent_pid=0), self.command(config.rank), host)
        worker.last_seen = time.monotonic()  # the join deadline counts from here
        with self._lock:
            self._workers[config.rank] = worker
        log.info("remote.waiting", rank=config.rank, host=host, command=worker.command)
        return worker

    async def aclose(self) -> None:
        """Tell joined workers still running to exit, stop listening, and close ``local``.

        Never raises.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            with self._lock:
                for worker in self._workers.values():
                    if worker.joined and worker.returncode is None:
                        worker.kill()
            self._stopping.set()
            await anyio.to_thread.run_sync(thread.join)
        if self._local_opened:
            self._local_opened = False
            await self.local.aclose()

    # ------------------------------------------------------------------ control thread

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None and self._ctx is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while True:
                stopping = self._stopping.is_set()
                self._send_kills()
                self._flush(sock)
                if stopping:
                    break
                if poller.poll(_POLL_MS):
                    self._receive(sock)
                self._check_deadlines(time.monotonic())
        except Exception as exc:
            # The thread must not die silently: every remote rank would look alive forever.
            log.error("remote.control_failed", error=repr(exc))
            with self._lock:
                for worker in self._workers.values():
                    worker.end(LOST, f"the launcher's control thread failed: {exc!r}")
        finally:
            sock.close(linger=0)
            self._close_context()

    def _close_context(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        if self._ctx is not None:
            self._ctx.term()

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:
                continue
            message = decode_control(parts[1].bytes)
            identity = parts[0].bytes
            if isinstance(message, Join):
                peer = parts[1].get("Peer-Address") or "?"
                self._answer(identity, self._join(identity, message, str(peer)))
            elif isinstance(message, Beat):
                self._answer(identity, self._beat(message))
            elif isinstance(message, Bye):
                self._bye(message)

    def _answer(self, identity: bytes, message: ControlMessage | None) -> None:
        if message is not None:
            self._outbox.append((identity, message))

    def _join(self, identity: bytes, join: Join, peer: str) -> ControlMessage | None:
        if join.protocol != PROTOCOL:
            return Refuse(
                f"this runtime speaks control protocol {PROTOCOL}, the worker {join.protocol}: "
                "install the same mstar-async version on both hosts"
            )
        if not self.is_remote(join.rank):
            remote = "none" if self.ranks is None else sorted(self.ranks)
            return Refuse(
                f"rank {join.rank} is not a remote rank of this runtime (remote ranks: {remote})"
            )
        with self._lock:
            worker = self._workers.get(join.rank)
            if worker is None:
                return None  # its rank is not started yet: the worker asks again
            if worker.nonce == join.nonce:
                return self._welcome(worker)  # a resend: the first answer was lost
            if worker.returncode is not None:
                return Refuse(
                    f"rank {join.rank}'s worker was lost ({worker.detail}); it is not restarted "
                    "in this runtime: reopen the runtime"
                )
            if worker.joined:
                return Refuse(
                    f"rank {join.rank} is already served by pid {worker.pid} at {worker.peer}"
                )
            worker.nonce, worker.identity, worker.peer = join.nonce, identity, peer
            worker._pid = join.pid
            worker.last_seen = time.monotonic()
            worker.detail = f"joined from {join.host} ({peer}), pid {join.pid}"
        if worker.host is not None and not _same_host(worker.host, peer):
            log.warning("remote.unexpected_host", rank=join.rank, expected=worker.host, peer=peer)
        log.info("remote.joined", rank=join.rank, host=join.host, peer=peer, pid=join.pid)
        return self._welcome(worker)

    def _welcome(self, worker: RemoteWorker) -> Welcome:
        # The worker uses its own key folder and none of this host's paths.
        return Welcome(
            replace(worker.config, curve_keys="", curve_material={}).__dict__,
            data_port=self._data_port or _port_of(worker.config.endpoint),
            heartbeat=self.heartbeat,
            timeout=self.timeout,
            data_host=self.data_host or "",
        )

    def _beat(self, beat: Beat) -> ControlMessage:
        with self._lock:
            worker = next((w for w in self._workers.values() if w.nonce == beat.nonce), None)
            if worker is None or worker.returncode is not None:
                return Stop("this runtime no longer counts on this worker")
            worker.last_seen = time.monotonic()
        return Beat()

    def _bye(self, bye: Bye) -> None:
        with self._lock:
            for worker in self._workers.values():
                if worker.nonce == bye.nonce:
                    why = f": {bye.error}" if bye.error else ""
                    worker.end(bye.code, f"its worker exited with status {bye.code}{why}")

    def _check_deadlines(self, now: float) -> None:
        with self._lock:
            for worker in self._workers.values():
                if worker.returncode is not None:
                    continue
                quiet = now - worker.last_seen
                if not worker.joined and quiet > self.join_timeout:
                    worker.end(
                        LOST,
                        f"no worker joined within {self.join_timeout:g} s: run "
                        f"`{worker.command}` on {worker.host or 'its host'}",
                    )
                elif worker.joined and quiet > self.timeout:
                    worker.end(
                        LOST,
                        f"its worker (pid {worker.pid} at {worker.peer}) sent no heartbeat for "
                        f"{self.timeout:g} s: it, its host or the network to it is down",
                    )
                    log.warning("remote.lost", rank=worker.rank, peer=worker.peer)

    def _send_kills(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                if worker._kill.is_set() and worker.identity is not None:
                    worker._kill.clear()
                    self._outbox.append((worker.identity, Stop("killed by the runtime")))

    def _flush(self, sock: zmq.Socket[bytes]) -> None:
        while self._outbox:
            identity, message = self._outbox.popleft()
            try:
                sock.send_multipart([identity, encode_control(message)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the worker went away: its deadline ends it


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _same_host(expected: str, peer: str) -> bool:
    try:
        infos = socket.getaddrinfo(expected.strip("[]"), None)
    except (OSError, UnicodeError):
        return False
    if peer in {info[4][0] for info in infos}:
        return True
    # A worker on the conductor's own host may come in over loopback.
    return is_this_host(expected) and is_this_host(peer)
