"""``WorkerPool``: one worker process per rank, started, supervised, restarted and stopped.

A ``Launcher`` starts the workers: child processes of this one by default (``LocalLauncher``),
or Ray actors anywhere on a Ray cluster (``RayLauncher``). The pool binds one ROUTER socket (IPC,
or TCP when the launcher's workers may live on other hosts); each worker connects a DEALER with
an identity naming its rank and generation (a restarted rank is a new peer, so no stale
connection can take its messages). A ``Ping`` is matched to its ``Pong`` by a sequence number.
When a worker dies, its walks fail with ``WorkerLost`` naming the rank, and a new worker takes
the rank.

The conductor sends walks (``StartWalk``, feeds, credit, cancels) and hears their outputs; no
node step and no request state passes through it (``stats`` counts what does).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

from mstar_async.errors import WorkerLost
from mstar_async.graph import ModelSource, PortRef
from mstar_async.graph.segments import WalkSplit
from mstar_async.logs import get_logger
from mstar_async.transport import (
    STATE_MOVED,
    DropState,
    FeedWalk,
    FetchState,
    Hello,
    Message,
    Peers,
    Ping,
    Pong,
    Release,
    Server,
    Shutdown,
    StartWalk,
    StateReply,
    TransportError,
    WalkCredit,
    WalkUpdates,
    ZmqHub,
    decode_message,
)
from mstar_async.transport.secure import is_loopback
from mstar_async.walks.run import OUTPUT_WINDOW, WalkSink
from mstar_async.worker.launchers import Launcher, LocalLauncher, WorkerHandle
from mstar_async.worker.main import WorkerConfig, identity
from mstar_async.worker.segmented import SegmentedWalk
from mstar_async.worker.settings import RuntimeSettings
from mstar_async.worker.state_moves import state_bytes
from mstar_async.worker.wire_types import register_wire_types

log = get_logger("mstar_async.worker.pool")

#: Outputs read before their credit is sent back (see ``_walk_credit``): half the window.
CREDIT_BATCH = max(1, OUTPUT_WINDOW // 2)

#: What the conductor says to workers, by kind: walks (their start, inputs, credit, outputs)
#: and the workers' lifecycle. Any other message through the conductor would be per-step
#: traffic (``PoolStats.step_messages``).
_WALK_KINDS = frozenset(k.__name__ for k in (StartWalk, FeedWalk, WalkCredit, WalkUpdates))
_CONTROL_KINDS = frozenset(k.__name__ for k in (Hello, Peers, Ping, Pong, Release, Shutdown))
#: Messages that carry a request's engine state: worker to worker only.
_STATE_KINDS = frozenset(k.__name__ for k in (FetchState, StateReply, DropState))


@dataclass(frozen=True)
class PoolStats:
    """What passed through the conductor (this process) to and from the workers: messages by
    kind each way, every byte received, and of those the bytes of any request's engine state
    (a KV moving between ranks goes worker to worker, so 0). ``step_messages`` counts messages
    of neither a walk nor the workers' lifecycle: a node step sent by the conductor would be
    one (walks run their steps on the workers, so 0)."""

    messages_sent: dict[str, int]
    messages_received: dict[str, int]
    bytes_received: int
    state_bytes: int

    @property
    def step_messages(self) -> int:
        """Messages either way that are neither walk traffic nor lifecycle."""
        known = _WALK_KINDS | _CONTROL_KINDS
        both = Counter(self.messages_sent) + Counter(self.messages_received)
        return sum(n for kind, n in both.items() if kind not in known)


class _Waiter:
    __slots__ = ("done", "error", "outputs")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.outputs: Any = None
        self.error: BaseException | None = None


@dataclass
class _Rank:
    rank: int
    engines: frozenset[str]
    generation: int = 0
    worker: WorkerHandle | None = None
    ready: anyio.Event = field(default_factory=anyio.Event)
    in_flight: dict[int, _Waiter] = field(default_factory=dict)
    restarts: int = 0
    down: str = ""  # why the rank was not restarted
    peer_endpoint: str = ""

    @property
    def identity(self) -> bytes:
        return identity(self.rank, self.generation)


def _details(states: Iterable[_Rank]) -> str:
    # A launcher's handle may say what it waits for or why it ended (a remote worker does).
    found = [
        f"rank {state.rank}: {detail}"
        for state in states
        if (detail := getattr(state.worker, "detail", ""))
    ]
    return f" ({'; '.join(found)})" if found else ""


class WorkerPool:
    """Worker processes for ``engines_on`` (rank -> engine names) of the model ``source`` builds.

    Use as ``async with WorkerPool(...) as pool:``; entering starts every worker and waits for
    each to say it is ready (``ready_timeout`` seconds); leaving asks them to shut down, waits
    ``stop_timeout`` seconds, then kills what is left. ``settings`` reach every worker's
    batching loop; its ``threads`` is each worker's torch thread count (default: the cores
    shared out between the ranks and this process, so nobody oversubscribes them).
    ``launcher`` starts the workers (default: ``LocalLauncher()``, child processes over IPC); the
    pool calls its ``open`` on entry, binds TCP if it names a host (with the launcher's CURVE
    keys, or on loopback only without), and its ``aclose`` on exit.

    Raises:
        WorkerLost: a worker exited or failed to become ready in time while starting.
        TransportError: TCP without keys on a host that is not loopback, or keys without the
            runtime's secret key.
    """

    def __init__(
        self,
        source: ModelSource,
        engines_on: Mapping[int, frozenset[str]],
        *,
        settings: RuntimeSettings | None = None,
        ready_timeout: float = 180.0,
        stop_timeout: float = 10.0,
        log_level: str = "WARNING",
        launcher: Launcher | None = None,
    ) -> None:
        self.source = source
        self.ranks = {r: _Rank(r, frozenset(e)) for r, e in sorted(engines_on.items())}
        # The conductor's process computes too (detokenizing, chunking, small ops): it counts as a
        # participant, or a lone worker's torch threads would spin against it for the cores.
        self.settings = settings or RuntimeSettings()
        shared = max(1, (os.cpu_count() or 1) // (len(self.ranks) + 1))
        self.threads = self.settings.threads or shared
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.log_level = log_level
        self.launcher: Launcher = launcher if launcher is not None else LocalLauncher()
        self._ids = itertools.count()
        self._hub: ZmqHub | None = None
        self._server: Server | None = None
        self._endpoint = ""
        self._curve_folder = ""  # where workers find the CURVE keys, when the pool has TCP keys
        self._curve_material: dict[str, str] = {}  # or the keys themselves, made for the run
        self._tg: TaskGroup | None = None
        self._closing = False
        self._walks: dict[int, tuple[int, WalkSink]] = {}  # walk id -> (rank, sink)
        self._unsent: set[int] = set()  # walks whose StartWalk waits for a rank to be ready
        self._outgoing: list[tuple[int, StartWalk | FeedWalk]] = []
        self._feeds: dict[tuple[int, str], Callable[[], None]] = {}  # called once fed
        self._credits: dict[int, dict[int, int]] = {}
        self._cancels: dict[int, list[int]] = {}
        self._awaiting_ready: set[int] = set()
        self._send_wake = asyncio.Event()
        self._moving: dict[int, set[int]] = {}  # walk id -> ranks its request's state leaves
        self.bytes_received = 0
        """Bytes of every message workers sent this process (headers and tensor frames): what
        crossed into the conductor. Tensors kept on workers (handles) do not count here, nor do
        those that came through shared memory (their frames carry only their names)."""
        self._sent: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._state_bytes = 0

    def stats(self) -> PoolStats:
        """What has passed through the conductor so far (see ``PoolStats``). Never raises."""
        return PoolStats(
            dict(self._sent), dict(self._received), self.bytes_received, self._state_bytes
        )

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> WorkerPool:
        register_wire_types()
        self._hub = ZmqHub()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            host = await self.launcher.open()
            if host is None:
                self._server = self._hub.bind()
                self._endpoint = self._server.endpoint
            else:
                # With keys, every interface, since the address workers dial may not be one
                # this host can bind by name, unless that is loopback (all on this host);
                # without, only the host named, which must then be loopback (the hub refuses
                # others). Workers are told the host the launcher named (and its port, when it
                # names one: a firewall may allow only that one).
                fixed = "0"
                if host.startswith("tcp://"):
                    host, _, fixed = host.removeprefix("tcp://").rpartition(":")
                keys = self.launcher.curve_keys
                if keys is None:
                    self._server = self._hub.bind(f"tcp://{host}:{fixed}")
                else:
                    where = host if is_loopback(host) else "0.0.0.0"
                    self._server = self._hub.bind(
                        f"tcp://{where}:{fixed}", curve=keys.runtime_server()
                    )
                    self._curve_folder = "" if keys.folder is None else str(keys.folder)
                    self._curve_material = {} if keys.folder else keys.worker_material()
                port = self._server.endpoint.rsplit(":", 1)[1]
                self._endpoint = f"tcp://{host}:{port}"
            self._tg.start_soon(self._receive)
            self._tg.start_soon(self._send_walk_traffic)
            for state in self.ranks.values():
                await self._start(state)
            with anyio.fail_after(self.ready_timeout):
                for state in self.ranks.values():
                    await self._wait_ready(state)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, TimeoutError):
                missing = [r for r, state in self.ranks.items() if not state.ready.is_set()]
                raise WorkerLost(
                    f"worker rank(s) {missing} did not become ready within "
                    f"{self.ready_timeout} s{_details(self.ranks[r] for r in missing)}"
                ) from exc
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing = True
        with anyio.CancelScope(shield=True):
            await self._stop_all()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await self.launcher.aclose()
            if self._hub is not None:
                self._hub.close()

    async def _start(self, state: _Rank) -> None:
        assert self._tg is not None
        state.generation += 1
        state.ready = anyio.Event()
        config = WorkerConfig(
            rank=state.rank,
            generation=state.generation,
            endpoint=self._endpoint,
            source=self.source.to_dict(),
            engines=sorted(state.engines),
            parent_pid=os.getpid(),
            threads=self.threads,
            max_batch_size=self.settings.max_batch_size,
            max_batch_tokens=self.settings.max_batch_tokens,
            forward_time_bound_s=self.settings.forward_time_bound_s,
            log_level=self.log_level,
            curve_keys=self._curve_folder,
            curve_material=self._curve_material,
            ranks=len(self.ranks),
        )
        state.worker = await self.launcher.start(config)
        log.info("worker.start", rank=state.rank, pid=state.worker.pid, generation=state.generation)
        self._tg.start_soon(self._supervise, state, state.worker)

    async def _wait_ready(self, state: _Rank) -> None:
        await state.ready.wait()
        if state.worker is None or state.worker.returncode is not None:
            raise WorkerLost(
                f"worker rank {state.rank} exited before it was ready{_details([state])}"
            )

    async def _supervise(self, state: _Rank, worker: WorkerHandle) -> None:
        code = await worker.wait()
        if self._closing or worker is not state.worker:
            return
        lost = WorkerLost(
            f"worker rank {state.rank} (pid {worker.pid}) died with exit code {code}; "
            f"its walks failed{_details([state])}"
        )
        log.warning("worker.lost", rank=state.rank, pid=worker.pid, code=code)
        state.ready.set()  # wake anyone waiting for a start that will not come
        for waiter in state.in_flight.values():
            waiter.error = lost
            waiter.done.set()
        state.in_flight.clear()
        for walk_id, (rank, sink) in list(self._walks.items()):
            if rank == state.rank:
                del self._walks[walk_id]
                self._walk_gone(walk_id)
                sink.end({}, lost)
            elif state.rank in self._moving.get(walk_id, ()):
                # Its request's state was on its way from the lost rank: it cannot come.
                self._walk_cancel(rank, walk_id)
                del self._walks[walk_id]
                self._walk_gone(walk_id)
                sink.end({}, WorkerLost(f"{lost}; walk {walk_id} was taking its state from it"))
        state.restarts += 1
        try:
            await self._start(state)
        except Exception as exc:
            # The rank stays down (open_walk_on says so) rather than taking the pool with it: a
            # launcher can fail where a fork would not (no free resources on a cluster).
            log.error("worker.restart_failed", rank=state.rank, error=repr(exc))
            state.down = str(exc)
            state.ready.set()

    async def _stop_all(self) -> None:
        for state in self.ranks.values():
            if state.worker is not None and state.worker.returncode is None:
                try:
                    assert self._server is not None
                    await self._send(state.identity, Shutdown())
                except (TransportError, AssertionError):
                    pass
        with anyio.move_on_after(self.stop_timeout):
            for state in self.ranks.values():
                if state.worker is not None:
                    await state.worker.wait()
        for state in self.ranks.values():
            if state.worker is not None and state.worker.returncode is None:
                state.worker.kill()
        # A local process is reaped at once; a remote worker's end is reported by its launcher,
        # which may not answer (a lost cluster): bounded, and aclose() cleans up after it.
        with anyio.move_on_after(self.stop_timeout):
            for state in self.ranks.values():
                if state.worker is not None:
                    await state.worker.wait()

    # ------------------------------------------------------------------ traffic

    async def _receive(self) -> None:
        assert self._server is not None
        by_identity: dict[bytes, _Rank] = {}
        while True:
            peer, frames = await self._server.recv_frames()
            size = sum(len(f) for f in frames)
            self.bytes_received += size
            try:
                message = decode_message(frames)
            except TransportError as exc:
                log.warning("pool.bad_message", error=str(exc))
                continue
            kind = type(message).__name__
            self._received[kind] += 1
            if kind in _STATE_KINDS:
                # The frames, and the tensors that came through shared memory beside them.
                self._state_bytes += size + state_bytes(getattr(message, "state", None))
            if isinstance(message, Hello):
                hello = self.ranks[message.rank]
                if peer == hello.identity:
                    by_identity[peer] = hello
                    hello.peer_endpoint = message.peer_endpoint
                    await self._send_peers(by_identity)
                    hello.ready.set()
                continue
            sender = by_identity.get(peer)
            if sender is not None and isinstance(message, WalkUpdates):
                self._walk_updates(message)
                continue
            if sender is None or not isinstance(message, Pong):
                continue
            waiter = sender.in_flight.pop(message.id, None)
            if waiter is None:
                continue  # its submitter was cancelled
            self._answer(waiter, message)

    def _walk_updates(self, message: WalkUpdates) -> None:
        walks = self._walks
        for walk_id, port, value, iteration in message.events:
            if port == STATE_MOVED:
                self._moving.pop(walk_id, None)
                continue
            entry = walks.get(walk_id)
            if entry is not None:
                entry[1].emit(port, value, iteration)
        for walk_id, persisted in message.ended:
            entry = walks.pop(walk_id, None)
            self._walk_gone(walk_id)
            if entry is not None:
                left = {PortRef.parse(k, role="walk output"): v for k, v in persisted.items()}
                entry[1].end(left, None)
        for walk_id, error in message.errors.items():
            entry = walks.pop(walk_id, None)
            self._walk_gone(walk_id)
            if entry is not None:
                entry[1].end({}, error.to_exception())
        for walk_id, port in message.fed:
            on_fed = self._feeds.pop((walk_id, port), None)
            if on_fed is not None:
                on_fed()

    # ------------------------------------------------------------------ hosted walks

    def open_walk_on(
        self,
        rank: int,
        request_id: str,
        walk: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkSink,
        *,
        window: int = OUTPUT_WINDOW,
        ranks: Mapping[str, int] | None = None,
        walk_id: int | None = None,
        peers: Mapping[int, int] | None = None,
        moves: Mapping[str, int] | None = None,
    ) -> RemoteWalk:
        """Start walk ``walk`` of ``request_id`` on ``rank``'s worker (every node of it is
        there, or with ``ranks``, node -> rank, the part of it on ``rank``: see
        ``open_segments``, which gives each segment its ``walk_id`` from ``reserve_ids`` and
        the ``peers``, rank -> segment id); its outputs and end reach ``sink``. ``moves``
        (engine -> rank) names the request's state the worker takes from other ranks before
        the walk starts. Never raises: a lost worker, or the loss of a rank the state comes
        from before it has come, ends the walk with ``WorkerLost``."""
        state = self.ranks[rank]
        walk_id = next(self._ids) if walk_id is None else walk_id
        if state.worker is None or state.worker.returncode is not None:
            why = f": {state.down}" if state.down else ""
            sink.end({}, WorkerLost(f"worker rank {rank} is down{why}"))
            return RemoteWalk(self, rank, walk_id)
        self._walks[walk_id] = (rank, sink)
        self._unsent.add(walk_id)
        message = StartWalk(
            walk_id,
            request_id,
            walk,
            {str(k): v for k, v in inputs.items()},
            dict(params),
            {str(k): v for k, v in persisted.items()},
            window,
            dict(ranks or {}),
            dict(peers or {}),
            dict(moves or {}),
        )
        if moves:
            self._moving[walk_id] = set(moves.values())
        self._outgoing.append((rank, message))
        self._send_wake.set()
        return RemoteWalk(self, rank, walk_id)

    def reserve_ids(self, count: int) -> list[int]:
        """``count`` walk ids, in increasing order. A worker takes its walks' starts in id
        order, so segments started with reserved ids must be opened at once, without awaiting
        in between (as ``SegmentedWalk.start`` does)."""
        return [next(self._ids) for _ in range(count)]

    def open_segments(
        self,
        request_id: str,
        split: WalkSplit,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        sink: WalkSink,
        moves: Mapping[int, Mapping[str, int]] | None = None,
    ) -> SegmentedWalk:
        """Start a walk whose nodes span ranks as one segment per rank (see
        ``mstar_async.worker.segmented``); its outputs and end reach ``sink``. ``moves``: per
        rank, the request's state that rank takes from others first (see ``open_walk_on``).
        Never raises: a lost worker ends the walk with ``WorkerLost``."""
        walk = SegmentedWalk(self, split, sink)
        walk.start(request_id, inputs, params, persisted, moves or {})
        return walk

    def _walk_push(
        self, rank: int, walk_id: int, port: str, items: Any, on_fed: Callable[[], None]
    ) -> None:
        if walk_id not in self._walks:
            on_fed()  # ended: nobody reads the input any more
            return
        self._feeds[(walk_id, port)] = on_fed
        self._walk_send(rank, FeedWalk(walk_id, port, items))

    async def _walk_feed(self, rank: int, walk_id: int, port: str, items: Any) -> None:
        fed = asyncio.get_running_loop().create_future()
        self._walk_push(rank, walk_id, port, items, lambda: _settle(fed))
        try:
            await fed
        finally:
            self._feeds.pop((walk_id, port), None)

    def _walk_send(self, rank: int, message: FeedWalk) -> None:
        if message.id in self._walks:
            self._outgoing.append((rank, message))
            self._send_wake.set()

    def _walk_gone(self, walk_id: int) -> None:
        # Feeds waiting for room in a walk that has ended wait no more.
        self._unsent.discard(walk_id)
        self._moving.pop(walk_id, None)
        for key in [k for k in self._feeds if k[0] == walk_id]:
            self._feeds.pop(key)()

    def _walk_credit(self, rank: int, walk_id: int, count: int) -> None:
        # Credit goes back in halves of the window: a walk held at its window gets going
        # again after half of it was read, and a program that reads steadily costs the worker
        # one credit message per half window, not one per output. Smaller amounts ride along.
        credits = self._credits.setdefault(rank, {})
        total = credits[walk_id] = credits.get(walk_id, 0) + count
        if total >= CREDIT_BATCH:
            self._send_wake.set()

    def _walk_cancel(self, rank: int, walk_id: int) -> None:
        if walk_id in self._unsent:
            # Its start is not sent yet (it waits for a rank that is restarting, e.g. a
            # segment whose peer was lost): no worker has it, so it ends here, unsent.
            _, sink = self._walks.pop(walk_id)
            self._walk_gone(walk_id)
            sink.end({}, None)
        elif walk_id in self._walks:
            self._cancels.setdefault(rank, []).append(walk_id)
            self._send_wake.set()

    async def _send_walk_traffic(self) -> None:
        # One task sends walk starts, feeds, credit and cancels, in order per rank, so each
        # rank gets at most one credit message per turn of the event loop however many walks
        # read outputs. A rank that is restarting gets what is for it once it is ready again.
        held: dict[int, list[StartWalk | FeedWalk | WalkCredit]] = defaultdict(list)
        while True:
            await self._send_wake.wait()
            self._send_wake.clear()
            outgoing, self._outgoing = self._outgoing, []
            for rank, message in outgoing:
                held[rank].append(message)
            credits, self._credits = self._credits, {}
            cancels, self._cancels = self._cancels, {}
            for rank in sorted(set(credits) | set(cancels)):
                held[rank].append(WalkCredit(credits.get(rank, {}), cancels.get(rank, [])))
            for rank in list(held):
                queue = held[rank]
                while queue:
                    if isinstance(queue[0], StartWalk) and queue[0].id not in self._unsent:
                        queue.pop(0)  # cancelled (or its rank lost) before it could start
                        continue
                    # A segment starts once every rank of its walk is ready: its peers must
                    # know each other's endpoints before the first item goes worker to worker.
                    waits_for = _unready(self.ranks, rank, queue[0])
                    if waits_for is not None:
                        self._wake_when_ready(waits_for)
                        break
                    head = queue.pop(0)
                    if isinstance(head, StartWalk):
                        self._unsent.discard(head.id)
                    await self._send_walk_message(rank, head)
                if not queue:
                    del held[rank]

    def _wake_when_ready(self, state: _Rank) -> None:
        if state.rank in self._awaiting_ready:
            return
        self._awaiting_ready.add(state.rank)

        async def wake() -> None:
            await state.ready.wait()
            self._awaiting_ready.discard(state.rank)
            self._send_wake.set()

        assert self._tg is not None
        self._tg.start_soon(wake)

    async def _send_walk_message(
        self, rank: int, message: StartWalk | FeedWalk | WalkCredit
    ) -> None:
        state = self.ranks[rank]
        try:
            assert self._server is not None
            await self._send(state.identity, message)
        except TransportError as exc:
            if isinstance(message, StartWalk):
                entry = self._walks.pop(message.id, None)
                if entry is not None:
                    entry[1].end({}, WorkerLost(f"worker rank {rank} is unreachable: {exc}"))

    @staticmethod
    def _answer(waiter: _Waiter, message: Pong) -> None:
        waiter.outputs = message.stats
        waiter.done.set()

    async def _send(self, peer: bytes, message: Message) -> None:
        """Send ``message`` to the worker ``peer``, counted (see ``stats``).

        Raises:
            TransportError: the pool is not open, or the message cannot go.
        """
        if self._server is None:
            raise TransportError("the worker pool is not open")
        self._sent[type(message).__name__] += 1
        await self._server.send(peer, message)

    async def _send_peers(self, ready: Mapping[bytes, _Rank]) -> None:
        # Every worker that is up learns every peer endpoint, whenever one (re)starts.
        assert self._server is not None
        peers = Peers({s.rank: s.peer_endpoint for s in ready.values() if s.peer_endpoint})
        for peer, state in ready.items():
            if peer == state.identity:
                try:
                    await self._send(peer, peers)
                except TransportError:
                    pass  # gone: its supervisor restarts it, and the next Hello sends again

    async def _ask(self, rank: int, build: Callable[[int], Message]) -> Any:
        """Send ``build(id)`` to ``rank`` and wait for the reply with that id. A rank whose
        worker is lost and not yet replaced fails at once (its launcher may take long to start
        another: a Ray node to replace the lost one); one whose new worker is starting is
        waited for."""
        state = self.ranks[rank]
        lost = state.worker
        if lost is not None and lost.returncode is not None and not state.ready.is_set():
            why = f": {state.down}" if state.down else ""
            raise WorkerLost(f"worker rank {rank} was lost and is restarting{why}")
        with anyio.fail_after(self.ready_timeout):
            await state.ready.wait()
        if state.worker is None or state.worker.returncode is not None:
            why = f": {state.down}" if state.down else ""
            raise WorkerLost(f"worker rank {rank} is down{why}")
        assert self._server is not None
        message_id = next(self._ids)
        waiter = _Waiter()
        state.in_flight[message_id] = waiter
        try:
            try:
                await self._send(state.identity, build(message_id))
            except TransportError as exc:
                # The worker's connection is gone before its end is known (a remote worker is
                # known lost only when its heartbeats stop): it is lost for this message too.
                raise WorkerLost(f"worker rank {rank} is unreachable: {exc}") from exc
            await waiter.done.wait()
        finally:
            state.in_flight.pop(message_id, None)
        if waiter.error is not None:
            raise waiter.error
        return waiter.outputs

    async def worker_stats(self, rank: int) -> dict[str, Any]:
        """``rank``'s worker counters (``kv_blocks``, ``kv_handles``, ``kv_kept_blocks``,
        ``tensors_held``, ``tensor_bytes_held``, ...), asked over the wire, so all it did
        before is counted. Cancel-safe.

        Raises:
            WorkerLost: the worker died (or is restarting).
        """
        stats: dict[str, Any] = await self._ask(rank, Ping)
        return stats

    async def release_on(self, rank: int, request_id: str) -> None:
        """Tell ``rank``'s worker that ``request_id`` is over. Never raises."""
        state = self.ranks[rank]
        worker = state.worker
        if self._server is None or worker is None or worker.returncode is not None:
            return
        try:
            await self._send(state.identity, Release(request_id))
        except TransportError:
            pass  # the worker is gone; it held nothing that survives it

    @property
    def endpoint(self) -> str:
        """Where workers reach this pool (``ipc://...`` or ``tcp://HOST:PORT``); empty before
        the pool is entered."""
        return self._endpoint

    def pid(self, rank: int) -> int | None:
        """The process id currently serving ``rank``, on its own host (None while it restarts,
        or where the launcher cannot tell)."""
        worker = self.ranks[rank].worker
        return None if worker is None else worker.pid

    def restarts(self, rank: int) -> int:
        """How many times ``rank``'s worker was replaced after dying."""
        return self.ranks[rank].restarts

    def unready_ranks(self) -> dict[int, str]:
        """The ranks that cannot take a step now, each with why: its worker is starting or
        restarting (it has not said it is ready, or it has died and is being replaced), or it
        is down (its restart failed). Empty when every rank is up. Never raises."""
        out = {}
        for rank, state in self.ranks.items():
            dead = state.worker is not None and state.worker.returncode is not None
            if state.down:
                out[rank] = f"is down: {state.down}"
            elif dead or state.worker is None or not state.ready.is_set():
                out[rank] = "is restarting" if dead or state.restarts else "is starting"
        return out


def _unready(ranks: Mapping[int, _Rank], rank: int, message: Message) -> _Rank | None:
    """The rank that ``message`` for ``rank`` waits for: ``rank`` itself until it is ready,
    and for a segment's start, every rank of its walk."""
    involved = message.peers if isinstance(message, StartWalk) and message.peers else (rank,)
    for each in involved:
        if not ranks[each].ready.is_set():
            return ranks[each]
    return None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class RemoteWalk:
    """The conductor's handle on a walk (or a walk's segment) running in a worker process
    (see ``open_walk_on``)."""

    __slots__ = ("pool", "rank", "walk_id")

    def __init__(self, pool: WorkerPool, rank: int, walk_id: int) -> None:
        self.pool = pool
        self.rank = rank
        self.walk_id = walk_id

    def ack(self, count: int) -> None:
        """The reader took ``count`` outputs: credit goes back with the next message."""
        self.pool._walk_credit(self.rank, self.walk_id, count)

    def cancel(self) -> None:
        """Ask the worker to stop the walk; its end arrives in a later message."""
        self.pool._walk_cancel(self.rank, self.walk_id)

    async def feed(self, port: PortRef, items: Any) -> None:
        """Send items of the streamed input ``port``; returns once the worker has room for
        more (or the walk has ended). Cancel-safe."""
        await self.pool._walk_feed(self.rank, self.walk_id, str(port), items)

    def end_input(self, port: PortRef) -> None:
        """The streamed input ``port`` has ended."""
        self.end_stream(str(port))

    def end_stream(self, port: str) -> None:
        """The input ``port`` has ended. Never raises."""
        self.pool._walk_send(self.rank, FeedWalk(self.walk_id, port, None, True))
