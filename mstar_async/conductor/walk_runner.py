"""Runs one walk of one request: an interpreter over the walk's plan.

Every node is a coroutine; every edge is a value cell or a streaming channel that lives in the
scope (the walk's top level, or one loop iteration) named by the plan. A node fires once, or
once per chunk when it consumes a stream; each firing is one step submitted to the executor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from mstar_async.conductor.executor import materialize
from mstar_async.errors import RequestError, WalkInputError
from mstar_async.graph import (
    Block,
    DynamicLoop,
    EdgePlan,
    Loop,
    LoopStep,
    Node,
    NodeRef,
    Parallel,
    PortRef,
    Sequential,
    WalkPlan,
)
from mstar_async.streams import ChannelSender, EdgeReceiver, EdgeSender, open_edge
from mstar_async.transport import StepCall

if TYPE_CHECKING:
    from mstar_async.conductor.request import RequestContext


@dataclass(frozen=True, slots=True)
class WalkEvent:
    """One output of a walk as it is made: which port, its value, and the loop iteration."""

    port: str
    value: Any
    iteration: int


class _Cell:
    """The value of a plain edge: the producer's latest output, final once the producer ends."""

    __slots__ = ("done", "has_value", "value")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.has_value = False
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self.has_value = True

    async def get(self, edge: EdgePlan) -> Any:
        await self.done.wait()
        if not self.has_value:
            raise RequestError(
                f"edge {edge.edge}: node {edge.src.node!r} finished without producing "
                f"{edge.src} (a loop that ran no iteration, or a stream that carried nothing)"
            )
        return self.value


class _Scope:
    """The walk's top level, or one iteration of a loop."""

    def __init__(
        self,
        runner: WalkRunner,
        loop: Loop | DynamicLoop | None,
        parent: _Scope | None,
        fixed: dict[PortRef, Any],
        iteration: int,
    ) -> None:
        self.loop = loop
        self.parent = parent
        self.fixed = fixed
        self.iteration = iteration
        self.last: dict[PortRef, Any] = {}
        self.cells: dict[EdgePlan, _Cell] = {}
        self.senders: dict[EdgePlan, EdgeSender] = {}
        self.receivers: dict[EdgePlan, EdgeReceiver] = {}
        for edge in runner.plan.scope_edges.get(loop, ()):
            if edge.streaming:
                assert edge.edge.policy is not None
                sender, receiver = open_edge(
                    edge.edge.policy.fresh(), edge.edge.max_buffer, name=str(edge.edge)
                )
                runner.request.track(sender, receiver)
                self.senders[edge], self.receivers[edge] = sender, receiver
            else:
                self.cells[edge] = _Cell()

    def owner(self, loop: Loop | DynamicLoop | None) -> _Scope:
        scope: _Scope | None = self
        while scope is not None and scope.loop is not loop:
            scope = scope.parent
        assert scope is not None, "plan names a scope outside this one"
        return scope

    def close_now(self) -> None:
        for sender in self.senders.values():
            sender.close_now()
        for receiver in self.receivers.values():
            receiver.close()


def _as_items(value: Any) -> Any:
    # One firing is one stream item: a tensor gains the item axis, anything else is listed.
    if isinstance(value, torch.Tensor):
        return value.unsqueeze(0)
    return [value]


class WalkRunner:
    """Interprets one walk for one request and sends its outputs as ``WalkEvent``s."""

    def __init__(
        self,
        plan: WalkPlan,
        request: RequestContext,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        out: ChannelSender[WalkEvent],
    ) -> None:
        self.plan = plan
        self.request = request
        self.inputs = inputs
        self.params = params
        self.out = out
        self._outputs = frozenset(plan.outputs)

    async def run(self) -> None:
        """Run the whole walk. Cancel-safe: cancellation closes every channel it opened."""
        top = _Scope(self, None, None, {}, 0)
        try:
            await self._run_block(self.plan.walk.body, top)
        finally:
            top.close_now()

    async def _run_block(self, block: Block, scope: _Scope) -> None:
        if isinstance(block, NodeRef):
            await self._run_node(self.plan.nodes[block.name], scope)
        elif isinstance(block, Sequential):
            await self._run_sequential(block, scope)
        elif isinstance(block, Parallel):
            async with anyio.create_task_group() as tg:
                for branch in block.branches:
                    tg.start_soon(self._run_block, branch, scope)
        else:
            await self._run_loop(block, scope)
        await self._finalize(block, scope)

    async def _run_sequential(self, block: Sequential, scope: _Scope) -> None:
        pipelined = self.plan.pipelined[block]
        async with anyio.create_task_group() as tg:
            previous: tuple[anyio.Event, anyio.Event] | None = None
            for child, pipe in zip(block.children, pipelined, strict=True):
                if previous is not None:
                    await (previous[0] if pipe else previous[1]).wait()
                previous = (anyio.Event(), anyio.Event())
                tg.start_soon(self._run_child, child, scope, *previous)

    async def _run_child(
        self, block: Block, scope: _Scope, started: anyio.Event, done: anyio.Event
    ) -> None:
        started.set()
        await self._run_block(block, scope)
        done.set()

    async def _finalize(self, block: Block, scope: _Scope) -> None:
        for edge in self.plan.finalize_after.get(block, ()):
            target = scope.owner(edge.lca)
            if edge.streaming:
                await target.senders[edge].aclose()
            else:
                target.cells[edge].done.set()

    async def _run_node(self, node: Node, scope: _Scope) -> None:
        streamed = self.plan.stream_input(node.name)
        inputs: dict[str, Any] = {}
        for port in node.inputs:
            ref = PortRef(node.name, port)
            if streamed is None or ref != streamed.dst:
                inputs[port] = await self._resolve(ref, scope)
        if streamed is None:
            await self._fire(node, inputs, scope)
            return
        async for chunk in scope.owner(streamed.lca).receivers[streamed]:
            await self._fire(node, {**inputs, streamed.dst.port: chunk}, scope)

    async def _resolve(self, ref: PortRef, scope: _Scope) -> Any:
        search: _Scope | None = scope
        while search is not None:
            if ref in search.fixed:
                return search.fixed[ref]
            search = search.parent
        edge = self.plan.in_edge.get(ref)
        if edge is not None:
            return await scope.owner(edge.lca).cells[edge].get(edge)
        if ref in self.inputs:
            return self.inputs[ref]
        source = self.plan.persisted_in.get(ref)
        if source is not None:
            if source in self.request.persisted:
                return self.request.persisted[source]
            raise WalkInputError(
                f"walk {self.plan.walk.name!r} needs {ref}, which {source} feeds from another "
                f"walk; run that walk first in this request, or pass {ref.port}=..."
            )
        raise WalkInputError(
            f"walk {self.plan.walk.name!r} needs input {ref}; pass {ref.port}=... "
            f"(or '{ref}'=...) when you run it"
        )

    async def _fire(self, node: Node, inputs: dict[str, Any], scope: _Scope) -> None:
        call = StepCall(
            self.request.request_id, node.engine, node.op, inputs, node.name, self.plan.walk.name
        )
        outputs = await self.request.executor.submit(call)
        for port in node.outputs:
            if port not in outputs:
                raise RequestError(
                    f"node {node.name!r}: engine {node.engine!r} op {node.op!r} returned "
                    f"{sorted(outputs)} but the node declares output {port!r}"
                )
            await self._publish(PortRef(node.name, port), outputs[port], scope)

    async def _publish(self, ref: PortRef, value: Any, scope: _Scope) -> None:
        # ``value`` may be a handle to a tensor left on a worker: steps take it as it is, and it
        # is fetched only where the conductor itself needs the tensor (a policy, the program).
        search: _Scope | None = scope
        while search is not None:
            search.last[ref] = value
            search = search.parent
        seen: Any = None  # the tensor behind a handle, once fetched
        for edge in self.plan.out_edges.get(ref, ()):
            target = scope.owner(edge.lca)
            if edge.streaming:
                seen = seen if seen is not None else await self._see(value)
                await target.senders[edge].send(_as_items(seen))
            else:
                target.cells[edge].set(value)
        if ref in self.plan.persisted_out:
            self.request.persisted[ref] = value
        if ref in self._outputs:
            seen = seen if seen is not None else await self._see(value)
            await self.out.send(WalkEvent(str(ref), seen, scope.iteration))

    async def _see(self, value: Any) -> Any:
        return await materialize(self.request.executor, value)

    async def _run_loop(self, loop: Loop | DynamicLoop, scope: _Scope) -> None:
        fixed: dict[PortRef, Any] = {}
        streams: dict[PortRef, EdgeReceiver] = {}
        for edge in self.plan.loop_imports.get(loop, ()):
            if edge.streaming:
                streams[edge.dst] = scope.receivers[edge]
            else:
                fixed[edge.dst] = await scope.cells[edge].get(edge)
        carried: dict[PortRef, Any] = {}
        for iteration in range(self._iterations(loop)):
            current = {**fixed, **carried}
            for port, receiver in streams.items():
                try:
                    current[port] = await receiver.receive()
                except anyio.EndOfStream:
                    return
            inner = _Scope(self, loop, scope, current, iteration)
            try:
                await self._run_block(loop.body, inner)
            finally:
                inner.close_now()
            carried = self._carry(loop, inner.last)
            if isinstance(loop, DynamicLoop):
                executor = self.request.executor
                outputs = {
                    str(ref): await materialize(executor, value)
                    for ref, value in inner.last.items()
                }
                if loop.until(LoopStep(iteration, outputs, self.params)):
                    return

    def _iterations(self, loop: Loop | DynamicLoop) -> int:
        if isinstance(loop, DynamicLoop):
            return loop.max_iterations
        if isinstance(loop.iterations, int):
            return loop.iterations
        value = self.params.get(loop.iterations)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WalkInputError(
                f"walk {self.plan.walk.name!r}: its Loop takes its iteration count from parameter "
                f"{loop.iterations!r}; pass params={{{loop.iterations!r}: <int >= 1>}} "
                f"(got {value!r})"
            )
        return value

    @staticmethod
    def _carry(loop: Loop | DynamicLoop, last: Mapping[PortRef, Any]) -> dict[PortRef, Any]:
        carried: dict[PortRef, Any] = {}
        for src, dsts in loop.carry.items():
            if src not in last:
                raise RequestError(f"loop carry: {src} produced nothing this iteration")
            for dst in dsts:
                carried[dst] = last[src]
        return carried
