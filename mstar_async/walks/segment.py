"""``SegmentRun``: one rank's part of a walk whose nodes span ranks (see ``graph.segments``).

The rank interprets the whole walk with the interpreter of ``run.py`` and runs only its own
units; reaching another rank's unit, it waits until that unit is reported done. What crosses to
other ranks leaves through the sink's ``relay``, in order, and goes to those ranks (worker to
worker: ``mstar_async.worker.peer_traffic``):

- ``ITEMS``: a firing's items on a streaming edge to another rank, one output credit each (the
  credit returns once the consumer's rank has room for them, so a producer is held while the far
  side is full); ``END``: that edge is closed;
- ``VALUE``: a plain edge's final value as ``[value]``, or ``[]`` when the producer made none;
- ``DONE``: a unit of this rank has finished (its number).

What comes in: items of a streaming edge arrive through ``feed`` / ``end_input`` like a streamed
walk input (the edge's policy and bound, on this rank), a plain edge's value through
``set_value``, another rank's finished unit through ``block_done``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from mstar_async.graph import Block, EdgePlan, PortRef, WalkPlan
from mstar_async.graph.segments import Segment
from mstar_async.walks.edge import StreamEdge
from mstar_async.walks.run import OUTPUT_WINDOW, Cell, Scope, WalkRun, WalkSink
from mstar_async.walks.trampoline import Flag, Trampoline

ITEMS = "items"
END = "end"
VALUE = "value"
DONE = "done"


@runtime_checkable
class SegmentSink(WalkSink, Protocol):
    """A sink that also carries what a segment sends other ranks."""

    def relay(self, kind: str, key: str | int, value: Any) -> None:
        """``kind`` is ``ITEMS``, ``END``, ``VALUE`` (``key``: the edge's ``"node.port"``) or
        ``DONE`` (``key``: the unit's number); in order, before the walk's ``end``."""
        ...


class SegmentRun(WalkRun):
    """One rank's segment of a walk: a ``WalkRun`` that skips other ranks' units, sends its
    edges to other ranks through ``sink.relay`` and takes theirs from outside."""

    def __init__(
        self,
        plan: WalkPlan,
        request_id: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        trampoline: Trampoline,
        sink: SegmentSink,
        segment: Segment,
        *,
        window: int = OUTPUT_WINDOW,
    ) -> None:
        super().__init__(
            plan, request_id, inputs, params, persisted, trampoline, sink, window=window
        )
        self.segment = segment
        self.relay = sink.relay
        self._remote_done = {index: Flag(trampoline) for index in segment.waits.values()}
        self._values_in = {
            edge.dst: edge for edge in segment.receives.values() if not edge.streaming
        }
        self._top: Scope | None = None

    def takes_value(self, port: PortRef) -> bool:
        """Whether ``port`` is fed by a plain edge from another rank (see ``set_value``).
        Never raises."""
        return port in self._values_in

    def set_value(self, port: PortRef, items: list[Any]) -> None:
        """The final value of the plain edge into ``port``: ``[value]``, or ``[]`` when its
        producer made none. Idempotent after the walk has ended.

        Raises:
            KeyError: no plain edge from another rank feeds ``port``.
        """
        edge = self._values_in[port]
        if self.ended:
            return
        assert self._top is not None, "set_value before start"
        cell = self._top.cells[edge]
        if items:
            cell.set(items[0])
        cell.close()

    def block_done(self, index: int) -> None:
        """Another rank's unit ``index`` has finished.

        Raises:
            KeyError: ``index`` is not a unit this segment waits for.
        """
        self._remote_done[index].set()

    async def send_items(self, key: str, items: Any) -> None:
        """Relay a firing's items on the streaming edge ``key`` once the output credit allows
        (a walk coroutine awaits it; closed while it waits, nothing is relayed)."""
        while self.unacked >= self.window:
            await self._credit
        self.unacked += 1
        self.relay(ITEMS, key, items)

    def _top_scope(self) -> Scope:
        top = self._top = super()._top_scope()
        for edge, key in self.segment.sends.items():
            if edge.streaming:
                top.streams[edge] = _RemoteStream(self, edge, key)
            else:
                top.cells[edge] = _RemoteCell(self, key)
        for edge in self.segment.receives.values():
            if edge.streaming:
                self._fed[edge.dst] = top.streams[edge]
        return top

    async def _run_block(self, block: Block, scope: Scope) -> None:
        index = self.segment.waits.get(block)
        if index is not None:
            await self._remote_done[index].wait()
            return
        await super()._run_block(block, scope)
        index = self.segment.reports.get(block)
        if index is not None:
            self.relay(DONE, index, None)


class _RemoteCell(Cell):
    """The producer's end of a plain edge to another rank: the final value is relayed."""

    __slots__ = ("key", "run")

    def __init__(self, run: SegmentRun, key: str) -> None:
        super().__init__(run.trampoline)
        self.run = run
        self.key = key

    def close(self) -> None:
        super().close()
        self.run.relay(VALUE, self.key, [self.value] if self.has_value else [])


class _RemoteStream(StreamEdge):
    """The producer's end of a streaming edge to another rank. The consumer's rank runs the
    edge's policy and holds its bounded buffer; here each send is relayed under the walk's
    output credit, and ``close`` relays the end."""

    __slots__ = ("key", "run")

    def __init__(self, run: SegmentRun, edge: EdgePlan, key: str) -> None:
        assert edge.edge.policy is not None
        # The base's policy and buffer stay unused: the consumer's rank cuts the chunks.
        super().__init__(run.trampoline, edge.edge.policy, edge.edge.max_buffer)
        self.run = run
        self.key = key

    async def send(self, items: Any) -> None:
        if not self.closed:
            await self.run.send_items(self.key, items)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.run.relay(END, self.key, None)
