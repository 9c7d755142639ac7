"""A worker process's side of hosted walks: start what the conductor asks, send back what they
make, one ``WalkUpdates`` message per round.

Walk outputs collect in an outbox while the batching loop runs; a sender task wakes when the
loop lets other tasks run (after a round's forward) and sends everything collected as one
message. Credit and cancels arrive as ``WalkCredit``.

A walk whose request has engine state on another rank (its prefill ran there) first takes that
state worker to worker (``StateMoves``), then starts; the conductor hears ``STATE_MOVED`` once
the walk no longer needs the source rank.

A walk that spans ranks runs here as this rank's segment (``SegmentRun``): what it sends other
ranks, and what they send it, goes worker to worker (``PeerTraffic``), one ``PeerWalks`` per
peer per round. A large tensor on a plain edge stays in this worker's store and travels as a
handle, which the receiving worker fetches from here; so does one a walk leaves for later walks
of its request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from mstar_async.errors import PlacementError
from mstar_async.graph import Model, PortRef, WalkPlan
from mstar_async.graph.segments import Segment, split_walk
from mstar_async.logs import get_logger
from mstar_async.transport import (
    AFTER_UNIT,
    STATE_MOVED,
    UNIT_DONE,
    ErrorInfo,
    FeedWalk,
    Link,
    PeerWalks,
    StartWalk,
    TensorRef,
    TransportError,
    WalkCredit,
    WalkUpdates,
)
from mstar_async.walks.run import WalkRun
from mstar_async.walks.segment import DONE, VALUE, SegmentRun
from mstar_async.worker.peer_traffic import PeerTraffic, Route
from mstar_async.worker.state_moves import StateMoves
from mstar_async.worker.tensor_links import WorkerTensors
from mstar_async.worker.walk_loop import WalkLoop

log = get_logger("mstar_async.worker.walks")


class _Sink:
    """One hosted walk's ``SegmentSink``: its outputs and relays go to the service's outbox."""

    __slots__ = ("request_id", "service", "walk_id")

    def __init__(self, service: WalkService, walk_id: int, request_id: str) -> None:
        self.service = service
        self.walk_id = walk_id
        self.request_id = request_id

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.service.events.append([self.walk_id, port, value, iteration])
        self.service.wake()

    def relay(self, kind: str, key: str | int, value: Any) -> None:
        if kind == DONE:
            # After this segment's outputs so far, so the conductor orders later ranks' after.
            self.service.events.append([self.walk_id, UNIT_DONE, int(key), 0])
        if kind == VALUE and value:
            value = [self.service.tensors.store.hold(self.request_id, value[0])]
        self.service.peers.relay(self.walk_id, kind, key, value)

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        # What later walks take stays here when large, as for a plain edge to another rank.
        hold = self.service.tensors.store.hold
        kept = {ref: hold(self.request_id, value) for ref, value in persisted.items()}
        self.service.ended(self.walk_id, kept, error)


class WalkService:
    """Runs the walks the conductor starts on this worker's ``WalkLoop``."""

    def __init__(
        self, model: Model, loop: WalkLoop, link: Link, tensors: WorkerTensors, states: StateMoves
    ) -> None:
        self.model = model
        self.loop = loop
        self.link = link
        self.tensors = tensors
        self.states = states
        self.runs: dict[int, WalkRun] = {}
        self.events: list[Any] = []
        self.peers = PeerTraffic(self._deliver, self._later, self.runs.__contains__, self.wake)
        self._ended: list[Any] = []
        self._errors: dict[int, ErrorInfo] = {}
        self._fed: list[tuple[int, str]] = []
        # Walks whose inputs are still being fetched: what arrived for them meanwhile (feeds,
        # cancels, other ranks' finished units), applied in order once they start.
        self._starting: dict[int, list[Callable[[], None]]] = {}
        # Walks taking their request's state from another rank, or fetching their inputs:
        # walk id -> (request id, the scope a cancel stops them with).
        self._preparing: dict[int, tuple[str, anyio.CancelScope]] = {}
        # What peers sent walks whose start has not arrived yet (ids above every one begun).
        self._early: dict[int, list[Callable[[], None]]] = {}
        self._last_begun = -1
        self._splits: dict[tuple[str, tuple[tuple[str, int], ...]], Segment] = {}
        self._fetches: dict[int, set[anyio.CancelScope]] = {}  # walk id -> its values fetched
        self._wake = asyncio.Event()
        self._tasks: TaskGroup | None = None
        loop.after_walks = self.flush

    def peer_stats(self) -> dict[str, int]:
        """Entries this worker's segments sent to other workers and took in from them."""
        return {
            "peer_entries_sent": self.peers.sent_entries,
            "peer_entries_taken": self.peers.taken_entries,
        }

    def wake(self) -> None:
        """Something is waiting in the outbox."""
        self._wake.set()

    def begin(self, message: StartWalk) -> None:
        """Note that walk ``message.id`` is starting (call in message order, before
        ``start``), so feeds and cancels that arrive while its inputs are fetched wait."""
        self._starting[message.id] = self._early.pop(message.id, [])
        self._last_begun = max(self._last_begun, message.id)
        for walk_id in [w for w in self._early if w < message.id]:
            # Starts come in id order: this one will never start here; its peers go on.
            for arrival in self._early.pop(walk_id):
                arrival()
        if message.peers:
            self.peers.routes[message.id] = Route(
                self.tensors.store.rank, dict(message.ranks), dict(message.peers)
            )

    def start(self, message: StartWalk) -> None:
        """Start the walk ``message`` names (after ``begin``): at once when every value it
        carries is here and its request's state too, else once a task of ``serve`` has taken
        the state from the ranks that hold it and fetched the handles among the values (a hop
        through the event loop costs a message's transit on these machines). A bad walk, or
        one whose state cannot come, ends at once with its error. Never raises."""
        values = (*message.inputs.values(), *message.persisted.values())
        if message.moves or any(isinstance(value, TensorRef) for value in values):
            assert self._tasks is not None, "start walks while serve runs"
            scope = anyio.CancelScope()
            self._preparing[message.id] = (message.request_id, scope)
            self._tasks.start_soon(self._prepare_and_start, message, scope)
        else:
            self._launch(message, message.inputs, message.persisted)

    async def _prepare_and_start(self, message: StartWalk, scope: anyio.CancelScope) -> None:
        # Cancel-safe: nothing is started when cancelled while preparing; the request's
        # release frees what a move left on either rank.
        try:
            with scope:
                for engine, source in message.moves.items():
                    await self.states.take(message.request_id, engine, source)
                if message.moves:
                    self.events.append([message.id, STATE_MOVED, None, 0])
                    self.wake()
                inputs = {k: await self._local(v) for k, v in message.inputs.items()}
                persisted = {k: await self._local(v) for k, v in message.persisted.items()}
        except Exception as exc:
            self._preparing.pop(message.id, None)
            self._fail_start(message, exc)
            return
        except BaseException:
            self._preparing.pop(message.id, None)
            self._starting.pop(message.id, None)
            raise
        self._preparing.pop(message.id, None)
        if scope.cancelled_caught:  # the conductor cancelled the walk, or released its request
            self._starting.pop(message.id, None)
            self.ended(message.id, {}, None)
            return
        self._launch(message, inputs, persisted)

    def _launch(
        self, message: StartWalk, inputs: Mapping[str, Any], persisted: Mapping[str, Any]
    ) -> None:
        try:
            plan = self.model.plan(message.walk)
            segment = self._segment(plan, message.ranks) if message.ranks else None
            ports = {PortRef.parse(k, role="walk input"): v for k, v in inputs.items()}
            kept = {PortRef.parse(k, role="walk input"): v for k, v in persisted.items()}
        except Exception as exc:
            self._fail_start(message, exc)
            return
        sink = _Sink(self, message.id, message.request_id)
        run = self.loop.start_walk(
            plan,
            message.request_id,
            ports,
            message.params,
            kept,
            sink,
            window=message.window,
            segment=segment,
        )
        self.runs[message.id] = run
        for early in self._starting.pop(message.id):
            early()

    def _fail_start(self, message: StartWalk, error: Exception) -> None:
        self._starting.pop(message.id, None)
        _Sink(self, message.id, message.request_id).end({}, error)

    def _segment(self, plan: WalkPlan, ranks: dict[str, int]) -> Segment:
        """This rank's segment of ``plan`` split by ``ranks`` (worked out once per layout).

        Raises:
            PlacementError: the conductor sent a layout that does not split the walk.
        """
        key = (plan.walk.name, tuple(sorted(ranks.items())))
        segment = self._splits.get(key)
        if segment is None:
            split = split_walk(plan, ranks)
            rank = self.tensors.store.rank
            if split is None or rank not in split.segments:
                raise PlacementError(
                    f"walk {plan.walk.name!r} cannot run as a segment on rank {rank} with "
                    f"nodes on ranks {ranks}"
                )
            segment = self._splits[key] = split.segments[rank]
        return segment

    async def _local(self, value: Any) -> Any:
        # A handle to a tensor another worker (or this one) holds: the walk needs the tensor.
        if isinstance(value, TensorRef):
            return await self.tensors.fetch(value)
        return value

    def credit(self, message: WalkCredit) -> None:
        """Return credit to walks and stop those the conductor cancelled."""
        for walk_id, count in message.credits.items():
            self._credit(walk_id, count)
        for walk_id in message.cancel:
            preparing = self._preparing.get(walk_id)
            if preparing is not None:
                preparing[1].cancel()
            self._apply(walk_id, lambda run: run.cancel())
        self.loop.kick()

    def _credit(self, walk_id: int, count: int) -> None:
        run = self.runs.get(walk_id)
        if run is not None:
            run.ack(count)

    def from_peer(self, message: PeerWalks) -> None:
        """What another rank's segments sent this worker's: entries, credit, finished units."""
        for walk_id, index in self.peers.take(message, self._credit):
            done = functools.partial(self._unit_done, walk_id, message.rank, index)
            self._apply(walk_id, done)
        self.loop.kick()

    def _unit_done(self, walk_id: int, rank: int, index: int, run: WalkRun) -> None:
        # Before what the segment makes now that the unit is done, so the conductor holds
        # those outputs until it has every output the unit's rank made before finishing it.
        self.events.append([walk_id, AFTER_UNIT, [rank, index], 0])
        self.wake()
        _block_done(run, index)

    def _later(self, walk_id: int, arrival: Callable[[], None]) -> bool:
        starting = self._starting.get(walk_id)
        if starting is not None:
            starting.append(arrival)
            return True
        if walk_id > self._last_begun:
            self._early.setdefault(walk_id, []).append(arrival)
            return True
        return False

    def _deliver(
        self,
        walk_id: int,
        port: PortRef,
        items: Any,
        end: bool,
        on_room: Callable[[], None] | None,
    ) -> None:
        run = self.runs.get(walk_id)
        if run is None:
            if on_room is not None:
                on_room()
            return
        try:
            if isinstance(run, SegmentRun) and run.takes_value(port):
                self._set_value(walk_id, run, port, items)
            elif end:
                run.end_input(port)
            else:
                assert on_room is not None
                run.feed(port, items, on_room)
        except Exception as exc:  # a bad entry fails its walk, not the worker
            run.group.cancel(exc)

    def _apply(self, walk_id: int, change: Callable[[WalkRun], None]) -> None:
        # To the walk's run, once it has started (a peer's finished unit can come before the
        # conductor's start does); nothing when it has ended. A bad change fails its walk, not
        # the worker.
        if self._later(walk_id, lambda: self._apply(walk_id, change)):
            return
        run = self.runs.get(walk_id)
        if run is None:
            return
        try:
            change(run)
        except Exception as exc:
            run.group.cancel(exc)

    def feed(self, message: FeedWalk) -> None:
        """Items (or the end) of a walk's streamed input; acknowledged once it has room."""
        starting = self._starting.get(message.id)
        if starting is not None:
            starting.append(lambda: self.feed(message))
            return
        run = self.runs.get(message.id)
        if run is None:
            self._acknowledge(message.id, message.port)  # the walk has ended: nothing waits
            return
        port = PortRef.parse(message.port, role="walk stream")
        try:
            if message.end:
                run.end_input(port)
            else:
                run.feed(port, message.items, lambda: self._acknowledge(message.id, message.port))
        except Exception as exc:  # a bad feed fails its walk, not the worker
            run.group.cancel(exc)
        finally:
            self.loop.kick()

    def _set_value(self, walk_id: int, run: SegmentRun, port: PortRef, items: list[Any]) -> None:
        if items and isinstance(items[0], TensorRef):
            assert self._tasks is not None, "WalkService.serve is not running"
            scope = anyio.CancelScope()  # cancelled if the walk ends first
            self._fetches.setdefault(walk_id, set()).add(scope)
            self._tasks.start_soon(self._fetch_value, walk_id, run, port, items[0], scope)
        else:
            run.set_value(port, items)

    async def _fetch_value(
        self,
        walk_id: int,
        run: SegmentRun,
        port: PortRef,
        ref: TensorRef,
        scope: anyio.CancelScope,
    ) -> None:
        # The value stayed on the rank that made it; the walk ends with the error if it
        # cannot come.
        with scope:
            try:
                value = await self.tensors.fetch(ref)
            except Exception as exc:
                run.group.cancel(exc)
            else:
                run.set_value(port, [value])
        self._fetches.get(walk_id, set()).discard(scope)
        self.loop.kick()

    def _acknowledge(self, walk_id: int, port: str) -> None:
        self._fed.append((walk_id, port))
        self.wake()

    def cancel_request(self, request_id: str) -> None:
        """Stop every walk of ``request_id`` still running or starting here (its release has
        come)."""
        for rid, scope in self._preparing.values():
            if rid == request_id:
                scope.cancel()
        for run in [r for r in self.runs.values() if r.request_id == request_id]:
            run.cancel()

    def ended(
        self, walk_id: int, persisted: dict[PortRef, Any], error: BaseException | None
    ) -> None:
        """A walk is over: its end goes out with the next message."""
        self.runs.pop(walk_id, None)
        self.peers.ended(walk_id)
        for scope in self._fetches.pop(walk_id, ()):
            scope.cancel()
        if error is None:
            self._ended.append([walk_id, {str(ref): value for ref, value in persisted.items()}])
        else:
            self._errors[walk_id] = ErrorInfo.from_exception(error)
        self.wake()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send what the walks made, one message per wake-up, and fetch the values segments
        receive as handles, until cancelled. Cancel-safe."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            try:
                await self._send_updates()
            finally:
                self._tasks = None

    def flush(self) -> None:
        """Send what the walks made since the last message now: the batching loop calls this
        before it waits for a threaded forward or for work (and every ``SEND_EVERY_S`` between
        inline rounds), so outputs leave without a hop through the event loop first. Not a
        coroutine.

        Raises:
            TransportError: the link to the conductor failed (the worker cannot go on).
        """
        if self.events or self._ended or self._errors or self._fed:
            message = WalkUpdates(self.events, self._ended, self._errors, self._fed)
            self.events, self._ended, self._errors, self._fed = [], [], {}, []
            self.link.send_nowait(message)

    async def _send_updates(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.flush()  # what the batching loop has not sent already
            rank = self.tensors.store.rank
            for peer, traffic in self.peers.messages(rank, self.tensors.knows):
                try:
                    await self.tensors.send(peer, traffic)
                except TransportError as exc:  # the peer is gone: the conductor ends its walks
                    log.warning("walks.peer_unreachable", rank=rank, peer=peer, error=str(exc))


def _block_done(run: WalkRun, index: int) -> None:
    assert isinstance(run, SegmentRun), "a unit finished elsewhere for a walk of one rank"
    run.block_done(index)
