"""``SegmentedWalk``: the conductor's handle on a walk that runs as segments on several ranks.

Each rank involved runs its segment of the walk (see ``mstar_async.walks.segment``): its loops,
carries and ``until`` stay on it, and nothing crosses per step. The conductor starts every
segment, giving each the ids of the others; from then on the segments send each other what
their edges carry, their credit and their finished units directly, worker to worker (see
``mstar_async.worker.peer_traffic``). The conductor sees only the walk's outputs, which reach
the program in order per rank with their credit returned to the rank that made each, and the
segments' ends. Across ranks, an output a segment made after it learnt of another rank's
finished unit waits here until every output that rank made before finishing the unit has
reached the program (the marks ``UNIT_DONE`` / ``AFTER_UNIT`` in the segments' updates), so a
sequential walk's outputs come in its order even though units finish worker to worker.
The walk ends once every segment has; on any segment's error (or a lost worker) or on cancel
every segment is cancelled, and the first error ends the walk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mstar_async.graph import PortRef
from mstar_async.graph.segments import WalkSplit
from mstar_async.transport import AFTER_UNIT, UNIT_DONE
from mstar_async.walks.run import WalkSink

if TYPE_CHECKING:
    from mstar_async.worker.pool import RemoteWalk, WorkerPool


class _Part:
    """One rank's segment, as the conductor sees it: the ``WalkSink`` its outputs reach."""

    __slots__ = ("ended", "handle", "pending", "rank", "remote", "units")

    def __init__(self, handle: SegmentedWalk, rank: int) -> None:
        self.handle = handle
        self.rank = rank
        self.remote: RemoteWalk | None = None
        self.ended = False
        self.units: set[int] = set()  # its units whose outputs have all been passed on
        self.pending: deque[tuple[str, Any, int]] = deque()  # what waits on another rank

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.pending.append((port, value, iteration))
        self.handle._drain(self)

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.handle._part_ended(self, persisted, error)


class SegmentedWalk:
    """A walk split across ranks (a ``WalkControl``): started with ``start``, then driven by
    what its segments send back. Use ``WorkerPool.open_segments``."""

    def __init__(self, pool: WorkerPool, split: WalkSplit, sink: WalkSink) -> None:
        self.pool = pool
        self.split = split
        self.sink = sink
        self.parts = {rank: _Part(self, rank) for rank in split.ranks}
        self._readers: deque[_Part] = deque()  # the part of each output the program has not read
        self._left: dict[PortRef, Any] = {}
        self._error: BaseException | None = None
        self._finished = False

    def start(
        self,
        request_id: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        moves: Mapping[int, Mapping[str, int]],
    ) -> None:
        """Start every rank's segment, each with the inputs and persisted values its own nodes
        take, and the request's state it takes from other ranks first (``moves``: rank ->
        engine -> source rank). Never raises: a rank that is down ends the walk with
        ``WorkerLost``."""
        split = self.split
        walk = split.plan.walk.name
        peers = dict(zip(self.parts, self.pool.reserve_ids(len(self.parts)), strict=True))
        for rank, part in self.parts.items():
            if part.ended:  # an earlier rank was down: the walk is over already
                continue
            mine = {ref: v for ref, v in inputs.items() if split.node_ranks[ref.node] == rank}
            kept = {
                src: persisted[src]
                for dst, src in split.plan.persisted_in.items()
                if split.node_ranks[dst.node] == rank and src in persisted
            }
            part.remote = self.pool.open_walk_on(
                rank,
                request_id,
                walk,
                mine,
                params,
                kept,
                part,
                ranks=split.node_ranks,
                walk_id=peers[rank],
                peers=peers,
                moves=moves.get(rank),
            )

    # --- WalkControl ---------------------------------------------------------------------------

    def ack(self, count: int) -> None:
        """The program read ``count`` more outputs: credit back to the ranks that made them.
        Never raises."""
        for _ in range(count):
            part = self._readers.popleft()
            if part.remote is not None and not part.ended:
                part.remote.ack(1)

    def cancel(self) -> None:
        """Stop every segment; the walk ends once all have. Idempotent, never raises."""
        self._cancel_parts()

    async def feed(self, port: PortRef, items: Any) -> None:
        """Items of the streamed walk input ``port``, to the rank of its node; returns once it
        has room (or the walk has ended). Cancel-safe."""
        remote = self.parts[self.split.node_ranks[port.node]].remote
        if remote is not None:
            await remote.feed(port, items)

    def end_input(self, port: PortRef) -> None:
        """The streamed walk input ``port`` has ended. Never raises."""
        remote = self.parts[self.split.node_ranks[port.node]].remote
        if remote is not None:
            remote.end_input(port)

    # --- what the segments send ----------------------------------------------------------------

    def _drain(self, part: _Part) -> None:
        """Pass on ``part``'s outputs in order, up to one that waits for a unit of another
        rank whose outputs have not all arrived."""
        pending = part.pending
        while pending:
            port, value, iteration = pending[0]
            if port == AFTER_UNIT:
                rank, unit = value
                waited = self.parts.get(rank)
                if waited is not None and unit not in waited.units:
                    return
                pending.popleft()
            elif port == UNIT_DONE:
                pending.popleft()
                part.units.add(value)
                for other in self.parts.values():
                    if other is not part and other.pending:
                        self._drain(other)
            else:
                pending.popleft()
                self._readers.append(part)
                self.sink.emit(port, value, iteration)

    def _part_ended(
        self, part: _Part, persisted: dict[PortRef, Any], error: BaseException | None
    ) -> None:
        part.ended = True
        self._left.update(persisted)
        if error is not None and self._error is None:
            self._error = error
            self._cancel_parts()
        if not self._finished and all(p.ended for p in self.parts.values()):
            self._finished = True
            self.sink.end(self._left if self._error is None else {}, self._error)

    def _cancel_parts(self) -> None:
        for part in self.parts.values():
            if part.remote is None:
                part.ended = True  # never started
            elif not part.ended:
                part.remote.cancel()
        if not self._finished and all(p.ended for p in self.parts.values()):
            self._finished = True
            self.sink.end({}, self._error)
