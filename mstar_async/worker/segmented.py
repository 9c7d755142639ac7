"""``SegmentedWalk``: the conductor's handle on a walk that runs as segments on several ranks.

Each rank involved runs its segment of the walk (see ``mstar_async.walks.segment``): its loops,
carries and ``until`` stay on it, and nothing crosses per step. The conductor starts every
segment, then relays between them what their edges carry, one hop through this process:

- a streaming edge's items go to the consumer's rank as ``FeedWalk``s, like a streamed walk
  input: one feed per edge in flight (items that arrive meanwhile go together in the next), the
  consumer's rank pushes them through the edge's policy into its bounded buffer and acknowledges
  once it has room, and only then does the producer's rank get their credit back; so a
  producer runs ahead of a slow consumer by at most the edge's bound, one feed and its output
  window;
- a plain edge's final value goes once, when its producer has finished;
- a finished unit (a block another rank waits for) is told to every other rank.

Walk outputs reach the program in order per rank, and credit returns to the rank that made each.
The walk ends once every segment has; on any segment's error (or a lost worker) or on cancel
every segment is cancelled, and the first error ends the walk. Direct worker-to-worker edges
would save the hop through this process; they are not built yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from mstar_async.graph import PortRef
from mstar_async.graph.segments import CrossEdge, WalkSplit
from mstar_async.walks.run import WalkSink
from mstar_async.walks.segment import DONE, END, ITEMS, VALUE

if TYPE_CHECKING:
    from mstar_async.worker.pool import RemoteWalk, WorkerPool


class _Part:
    """One rank's segment, as the conductor sees it: the ``WalkSink`` its outputs reach."""

    __slots__ = ("ended", "handle", "rank", "remote")

    def __init__(self, handle: SegmentedWalk, rank: int) -> None:
        self.handle = handle
        self.rank = rank
        self.remote: RemoteWalk | None = None
        self.ended = False

    def emit(self, port: str, value: Any, iteration: int) -> None:
        self.handle._emit(self, port, value, iteration)

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        self.handle._part_ended(self, persisted, error)

    def relay(self, kind: str, key: Any, value: Any) -> None:
        self.handle._relay(self, kind, key, value)


class _Edge:
    """A streaming edge between two ranks: items waiting to go, and the feed in flight."""

    __slots__ = ("closed", "cross", "end_sent", "in_flight", "waiting")

    def __init__(self, cross: CrossEdge) -> None:
        self.cross = cross
        self.waiting: deque[Any] = deque()
        self.in_flight = 0  # items of the feed the consumer's rank has not taken in yet
        self.closed = False
        self.end_sent = False


class SegmentedWalk:
    """A walk split across ranks (a ``WalkControl``): started with ``start``, then driven by
    what its segments send back. Use ``WorkerPool.open_segments``."""

    def __init__(self, pool: WorkerPool, split: WalkSplit, sink: WalkSink) -> None:
        self.pool = pool
        self.split = split
        self.sink = sink
        self.parts = {rank: _Part(self, rank) for rank in split.ranks}
        self._edges = {key: _Edge(c) for key, c in split.cross.items() if c.edge.streaming}
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
    ) -> None:
        """Start every rank's segment, each with the inputs and persisted values its own nodes
        take. Never raises: a rank that is down ends the walk with ``WorkerLost``."""
        split = self.split
        walk = split.plan.walk.name
        for rank, part in self.parts.items():
            if part.ended:  # an earlier rank was down: the walk is over already
                continue
            mine = {ref: v for ref, v in inputs.items() if split.node_ranks[ref.node] == rank}
            kept = {
                src: persisted[src]
                for dst, src in split.plan.persisted_in.items()
                if split.node_ranks[dst.node] == rank and src in persisted
            }
            remote = self.pool.open_walk_on(
                rank, request_id, walk, mine, params, kept, part, ranks=split.node_ranks
            )
            part.remote = remote
            remote.on_relay(part.relay)

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

    def _emit(self, part: _Part, port: str, value: Any, iteration: int) -> None:
        self._readers.append(part)
        self.sink.emit(port, value, iteration)

    def _relay(self, part: _Part, kind: str, key: Any, value: Any) -> None:
        if kind == ITEMS:
            edge = self._edges[key]
            edge.waiting.append(value)
            self._pump(edge)
        elif kind == END:
            edge = self._edges[key]
            edge.closed = True
            self._pump(edge)
        elif kind == VALUE:
            target = self.parts[self.split.cross[key].dst_rank]
            if target.remote is not None and not target.ended:
                target.remote.send_value(key, value)
        elif kind == DONE:
            for other in self.parts.values():
                if other is not part and other.remote is not None and not other.ended:
                    other.remote.block_done(key)

    def _pump(self, edge: _Edge) -> None:
        """Send the edge's waiting items (or its end) to the consumer's rank, unless a feed is
        in flight; their credit goes back to the producer once the consumer took them in."""
        if edge.in_flight:
            return
        source = self.parts[edge.cross.src_rank]
        target = self.parts[edge.cross.dst_rank]
        key = str(edge.cross.edge.dst)
        if target.ended or target.remote is None:
            self._credit(source, len(edge.waiting))  # nobody takes them: the producer goes on
            edge.waiting.clear()
        elif edge.waiting:
            items, count = _take(edge.waiting)
            edge.in_flight = count
            target.remote.push(key, items, lambda: self._fed(edge))
        elif edge.closed and not edge.end_sent:
            edge.end_sent = True
            target.remote.end_stream(key)

    def _fed(self, edge: _Edge) -> None:
        count, edge.in_flight = edge.in_flight, 0
        self._credit(self.parts[edge.cross.src_rank], count)
        self._pump(edge)

    @staticmethod
    def _credit(part: _Part, count: int) -> None:
        if count and part.remote is not None and not part.ended:
            part.remote.ack(count)

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


def _take(waiting: deque[Any]) -> tuple[Any, int]:
    """The first waiting relays joined into one feed (lists concatenated, tensors stacked on
    the item axis, as far as they match), and how many relays that is."""
    first = waiting.popleft()
    group = [first]
    while waiting and _joinable(first, waiting[0]):
        group.append(waiting.popleft())
    if len(group) == 1:
        return first, 1
    if isinstance(first, list):
        return [item for items in group for item in items], len(group)
    return torch.cat(group), len(group)


def _joinable(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return isinstance(b, list)
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape[1:] == b.shape[1:]
        and a.dtype == b.dtype
        and a.device == b.device
    )
