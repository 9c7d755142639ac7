"""Runs one walk of one request on the worker that holds its nodes: an interpreter over the plan.

Every node is a coroutine driven by the worker's ``Trampoline``; every edge is a value cell or
a streaming edge (a chunk policy feeding a bounded deque) that lives in the scope (the walk's
top level, or one loop iteration) the plan names. A node fires once, or once per chunk when it
consumes a stream; each firing is one ``StepRequest`` the worker batches with other requests'.
Loop iterations, carries and ``until`` run here, between rounds of the worker's batching loop,
with no event-loop task, event or thread hop of their own.

Outputs leave through a ``WalkSink`` with credit-based backpressure: at most ``window`` outputs
are unacknowledged at once; past that the walk waits until the reader acknowledges some.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import torch

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
    StreamEnd,
    WalkPlan,
)
from mstar_async.walks.edge import StreamEdge
from mstar_async.walks.trampoline import (
    Chain,
    Condition,
    Flag,
    StepRequest,
    TaskGroup,
    Trampoline,
)

#: How many outputs a walk may have in flight to its reader before it waits for credit.
OUTPUT_WINDOW = 16


class WalkSink(Protocol):
    """Where a running walk's outputs go (the conductor, in this process or over ZeroMQ)."""

    def emit(self, port: str, value: Any, iteration: int) -> None:
        """One output of the walk, in order."""
        ...

    def end(self, persisted: dict[PortRef, Any], error: BaseException | None) -> None:
        """The walk is over: the values it leaves for later walks, or the error that ended it
        (``None`` also when it was cancelled). Called exactly once, after the last ``emit``."""
        ...


class Cell:
    """The value of a plain edge: the producer's latest output, final once the producer ends."""

    __slots__ = ("done", "has_value", "value")

    def __init__(self, trampoline: Trampoline) -> None:
        self.done = Flag(trampoline)
        self.has_value = False
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self.has_value = True

    def close(self) -> None:
        """The producer has ended: the value is final."""
        self.done.set()

    async def get(self, edge: EdgePlan) -> Any:
        await self.done.wait()
        if not self.has_value:
            raise RequestError(
                f"edge {edge.edge}: node {edge.src.node!r} finished without producing "
                f"{edge.src} (a loop that ran no iteration, or a stream that carried nothing)"
            )
        return self.value


class Scope:
    """The walk's top level, or one iteration of a loop."""

    __slots__ = ("cells", "chain", "fixed", "iteration", "last", "loop", "parent", "streams")

    def __init__(
        self,
        run: WalkRun,
        loop: Loop | DynamicLoop | None,
        parent: Scope | None,
        fixed: dict[PortRef, Any],
        iteration: int,
        edges: Sequence[EdgePlan] | None = None,
    ) -> None:
        # ``edges``: the plan's ``scope_edges`` of ``loop``, when the caller has looked them up
        # once for every iteration.
        self.loop = loop
        self.parent = parent
        self.fixed = fixed
        self.iteration = iteration
        #: Set where this iteration's one node feeds the next iteration's (see ``_chain``).
        self.chain: Chain | None = None
        self.last: dict[PortRef, Any] = {}
        self.cells: dict[EdgePlan, Cell] = {}
        self.streams: dict[EdgePlan, StreamEdge] = {}
        for edge in run.plan.scope_edges.get(loop, ()) if edges is None else edges:
            if edge.streaming:
                assert edge.edge.policy is not None
                self.streams[edge] = StreamEdge(
                    run.trampoline, edge.edge.policy.fresh(), edge.edge.max_buffer
                )
            else:
                self.cells[edge] = Cell(run.trampoline)

    def owner(self, loop: Loop | DynamicLoop | None) -> Scope:
        scope: Scope | None = self
        while scope is not None and scope.loop is not loop:
            scope = scope.parent
        assert scope is not None, "plan names a scope outside this one"
        return scope


class _NodeFacts:
    """What firing a node needs, computed once per walk run: the streamed walk input it is fed
    (``fed``) or the streaming edge it consumes in its own scope (``streamed``), its other
    input refs, and per output port its ref, the edges it feeds, whether a later walk keeps it
    and the walk output name it is (if any)."""

    __slots__ = ("fed", "inputs", "node", "outputs", "streamed")

    def __init__(self, run: WalkRun, node: Node) -> None:
        plan = run.plan
        self.node = node
        self.fed: PortRef | None = run._fed_by_node.get(node.name)
        self.streamed: EdgePlan | None = plan.stream_input(node.name)
        skip = {self.fed, self.streamed.dst if self.streamed else None}
        refs = ((port, PortRef(node.name, port)) for port in node.inputs)
        self.inputs = [(port, ref) for port, ref in refs if ref not in skip]
        self.outputs = [
            (
                port,
                ref,
                tuple(plan.out_edges.get(ref, ())),
                ref in plan.persisted_out,
                run._outputs.get(ref),
            )
            for port, ref in ((port, PortRef(node.name, port)) for port in node.outputs)
        ]


_UNKNOWN = object()
_ENDED = StreamEnd()


def _as_items(value: Any) -> Any:
    # One firing is one stream item: a tensor gains the item axis, anything else is listed.
    if isinstance(value, torch.Tensor):
        return value.unsqueeze(0)
    return [value]


class WalkRun:
    """One walk of one request, running on this worker's trampoline.

    ``persisted`` holds the values earlier walks of the request left for this one (by the
    producing port). Start it with ``start()``; ``cancel()`` stops it between steps.
    """

    def __init__(
        self,
        plan: WalkPlan,
        request_id: str,
        inputs: Mapping[PortRef, Any],
        params: Mapping[str, Any],
        persisted: Mapping[PortRef, Any],
        trampoline: Trampoline,
        sink: WalkSink,
        *,
        window: int = OUTPUT_WINDOW,
    ) -> None:
        self.plan = plan
        self.request_id = request_id
        self.inputs = inputs
        self.params = params
        self.persisted_in = persisted
        self.trampoline = trampoline
        self.sink = sink
        self.window = window
        self.unacked = 0
        #: The most chunks any of the walk's streaming edges held for its consumer at once.
        self.peak_buffered = 0
        self.left: dict[PortRef, Any] = {}
        self._credit = Condition(trampoline)
        self._outputs = {ref: str(ref) for ref in plan.outputs}
        self._names: dict[PortRef, str] = {}
        self._walk_name = plan.walk.name
        self._fed = {
            ref: StreamEdge(trampoline, policy.fresh(), plan.walk.max_buffer)
            for ref, policy in plan.input_streams.items()
        }
        self._fed_by_node = {ref.node: ref for ref in self._fed}
        self._facts: dict[str, _NodeFacts] = {}
        self.group = TaskGroup(trampoline, self._ended)

    @property
    def ended(self) -> bool:
        """Whether the walk has finished, failed or been cancelled."""
        return self.group.ended

    def start(self) -> None:
        """Schedule the walk's first coroutine (it runs on the trampoline's next pass)."""
        self.group.spawn(self._main(self._top_scope()))

    def cancel(self) -> None:
        """Stop the walk now; its sink hears ``end`` with no error. Idempotent."""
        self.group.cancel(None)

    def ack(self, count: int) -> None:
        """The reader consumed ``count`` more outputs: that much credit returns."""
        self.unacked -= count
        self._credit.notify_all()

    def feed(self, port: PortRef, items: Any, on_space: Callable[[], None]) -> None:
        """Items of the streamed walk input ``port`` (a list, or a tensor whose dim 0 is the
        item axis). ``on_space`` is called once the input's buffer has room for more: at
        once, or when its node has taken chunks (or the walk has ended).

        Raises:
            KeyError: ``port`` is not a streamed input of this walk.
            PolicyError: the input was already ended.
        """
        stream = self._fed[port]
        if not self.ended:
            stream._put(stream.policy.push(items))
        if stream.full and not self.ended:
            stream.on_space.append(on_space)
        else:
            on_space()

    async def feed_async(self, port: PortRef, items: Any) -> None:
        """``feed`` for a caller on this walk's event loop: returns once the input has room
        (or the walk has ended); the trampoline's driver must be kicked after the call starts.
        Cancel-safe: the items were taken either way.

        Raises:
            KeyError: ``port`` is not a streamed input of this walk.
        """
        room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.feed(port, items, lambda: None if room.done() else room.set_result(None))
        await room

    def end_input(self, port: PortRef) -> None:
        """The streamed walk input ``port`` has ended; its node sees the last chunk. Idempotent.

        Raises:
            KeyError: ``port`` is not a streamed input of this walk.
        """
        stream = self._fed[port]
        if not self.ended:
            stream.close()

    def _ended(self, error: BaseException | None) -> None:
        for stream in self._fed.values():
            stream.abandon()
        self.sink.end(self.left if error is None else {}, error)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.group.spawn(coro)

    def _top_scope(self) -> Scope:
        # Made when the walk starts, not on its first pass: values from outside (a segment's
        # incoming edges) may arrive before the trampoline runs it.
        return Scope(self, None, None, {}, 0)

    async def _main(self, top: Scope) -> None:
        try:
            await self._run_block(self.plan.walk.body, top)
        finally:
            self._close_scope(top)

    async def _run_block(self, block: Block, scope: Scope) -> None:
        if isinstance(block, NodeRef):
            await self._run_node(self.plan.nodes[block.name], scope)
        elif isinstance(block, Sequential):
            await self._run_sequential(block, scope)
        elif isinstance(block, Parallel):
            await self._run_parallel(block, scope)
        else:
            await self._run_loop(block, scope)
        self._finalize(block, scope)

    async def _run_parallel(self, block: Parallel, scope: Scope) -> None:
        done = [Flag(self.trampoline) for _ in block.branches]
        for branch, flag in zip(block.branches, done, strict=True):
            self._spawn(self._run_child(branch, scope, None, flag))
        for flag in done:
            await flag.wait()

    async def _run_sequential(self, block: Sequential, scope: Scope) -> None:
        pipelined = self.plan.pipelined[block]
        if not any(pipelined):
            for child in block.children:
                await self._run_block(child, scope)
            return
        flags: list[tuple[Flag, Flag]] = []
        for child, pipe in zip(block.children, pipelined, strict=True):
            if flags:
                started, done = flags[-1]
                await (started if pipe else done).wait()
            flags.append((Flag(self.trampoline), Flag(self.trampoline)))
            self._spawn(self._run_child(child, scope, *flags[-1]))
        for _, done in flags:
            await done.wait()

    async def _run_child(
        self, block: Block, scope: Scope, started: Flag | None, done: Flag
    ) -> None:
        if started is not None:
            started.set()
        await self._run_block(block, scope)
        done.set()

    def _finalize(self, block: Block, scope: Scope) -> None:
        for edge in self.plan.finalize_after.get(block, ()):
            target = scope.owner(edge.lca)
            if edge.streaming:
                target.streams[edge].close()
            else:
                target.cells[edge].close()

    async def _run_node(self, node: Node, scope: Scope) -> None:
        facts = self._facts_of(node)
        fed, streamed = facts.fed, facts.streamed
        inputs: dict[str, Any] = {}
        for port, ref in facts.inputs:
            value = _in_scope(ref, scope)
            inputs[port] = await self._resolve(ref, scope) if value is _UNKNOWN else value
        if fed is not None:
            await self._fire_per_chunk(facts, inputs, scope, fed.port, self._fed[fed])
        elif streamed is None:
            await self._fire(facts, inputs, scope)
        else:
            stream = scope.owner(streamed.lca).streams[streamed]
            await self._fire_per_chunk(facts, inputs, scope, streamed.dst.port, stream)

    def _facts_of(self, node: Node) -> _NodeFacts:
        facts = self._facts.get(node.name)
        if facts is None:
            facts = self._facts[node.name] = _NodeFacts(self, node)
        return facts

    async def _fire_per_chunk(
        self,
        facts: _NodeFacts,
        inputs: dict[str, Any],
        scope: Scope,
        port: str,
        stream: StreamEdge,
    ) -> None:
        try:
            while (chunk := await stream.receive()) is not None:
                await self._fire(facts, {**inputs, port: chunk}, scope)
        finally:
            stream.abandon()

    async def _resolve(self, ref: PortRef, scope: Scope) -> Any:
        edge = self.plan.in_edge.get(ref)
        if edge is not None:
            return await scope.owner(edge.lca).cells[edge].get(edge)
        if ref in self.inputs:
            return self.inputs[ref]
        source = self.plan.persisted_in.get(ref)
        if source is not None:
            if source in self.persisted_in:
                return self.persisted_in[source]
            raise WalkInputError(
                f"walk {self.plan.walk.name!r} needs {ref}, which {source} feeds from another "
                f"walk; run that walk first in this request, or pass {ref.port}=..."
            )
        raise WalkInputError(
            f"walk {self.plan.walk.name!r} needs input {ref}; pass {ref.port}=... "
            f"(or '{ref}'=...) when you run it"
        )

    async def _fire(self, facts: _NodeFacts, inputs: dict[str, Any], scope: Scope) -> None:
        node = facts.node
        outputs = await StepRequest(
            self.request_id, node.engine, node.op, inputs, node.name, self._walk_name, scope.chain
        )
        for port, ref, edges, persisted, name in facts.outputs:
            if port not in outputs:
                raise RequestError(
                    f"node {node.name!r}: engine {node.engine!r} op {node.op!r} returned "
                    f"{sorted(outputs)} but the node declares output {port!r}"
                )
            value = outputs[port]
            search: Scope | None = scope
            while search is not None:
                search.last[ref] = value
                search = search.parent
            if edges:
                await self._publish(value, scope, edges)
            if name is not None:
                while self.unacked >= self.window:
                    await self._credit
                self.unacked += 1
                self.sink.emit(name, value, scope.iteration)
            if persisted:
                self.left[ref] = value

    async def _publish(self, value: Any, scope: Scope, edges: tuple[EdgePlan, ...]) -> None:
        for edge in edges:
            target = scope.owner(edge.lca)
            if edge.streaming:
                await target.streams[edge].send(_as_items(value))
            else:
                target.cells[edge].set(value)

    async def _run_loop(self, loop: Loop | DynamicLoop, scope: Scope) -> None:
        fixed: dict[PortRef, Any] = {}
        streams: dict[PortRef, StreamEdge] = {}
        for edge in self.plan.loop_imports.get(loop, ()):
            if edge.streaming:
                streams[edge.dst] = scope.streams[edge]
            else:
                fixed[edge.dst] = await scope.cells[edge].get(edge)
        try:
            await self._iterate(loop, scope, fixed, streams)
        finally:
            for stream in streams.values():
                stream.abandon()

    async def _iterate(
        self,
        loop: Loop | DynamicLoop,
        scope: Scope,
        fixed: dict[PortRef, Any],
        streams: dict[PortRef, StreamEdge],
    ) -> None:
        carried: dict[PortRef, Any] = {}
        until = loop.until if isinstance(loop, DynamicLoop) else None
        outlives = isinstance(loop, DynamicLoop) and loop.outlives_streams
        carries = [(src, tuple(dsts)) for src, dsts in loop.carry.items()]
        body = loop.body
        edges = self.plan.scope_edges.get(loop, ())
        chain = None if streams else self._chain(loop)
        last_iteration = self._iterations(loop) - 1
        for iteration in range(last_iteration + 1):
            # ``carried`` is made afresh each iteration, so without imports it serves as is.
            current = {**fixed, **carried} if fixed else carried
            for port, stream in streams.items():
                chunk = await stream.receive()
                if chunk is None:
                    if not outlives:
                        return
                    current[port] = _ENDED
                else:
                    current[port] = chunk
            inner = Scope(self, loop, scope, current, iteration, edges)
            if iteration < last_iteration:
                inner.chain = chain
            try:
                if isinstance(body, NodeRef):
                    await self._run_node(self.plan.nodes[body.name], inner)
                    self._finalize(body, inner)
                else:
                    await self._run_block(body, inner)
            finally:
                if inner.streams:
                    self._close_scope(inner)
            last = inner.last
            carried = _carry(carries, last) if carries else {}
            if until is not None:
                named = self._named(last)
                if until(LoopStep(iteration, named, self.params)):
                    return

    def _chain(self, loop: Loop | DynamicLoop) -> Chain | None:
        """Where a loop's body is one node that takes every carry from its own outputs, the
        next iteration's step is this one's with those outputs as inputs: the pairs, else
        None. Its other inputs come from outside the loop and stay as they are."""
        body = loop.body
        if not isinstance(body, NodeRef) or not loop.carry:
            return None
        node = self.plan.nodes[body.name]
        facts = self._facts_of(node)
        if facts.fed is not None or facts.streamed is not None:
            return None
        pairs = []
        for src, dsts in loop.carry.items():
            for dst in dsts:
                if src.node != node.name or dst.node != node.name:
                    return None
                pairs.append((src.port, dst.port))
        return tuple(pairs)

    def _named(self, last: Mapping[PortRef, Any]) -> dict[str, Any]:
        """``last`` by port name."""
        names = self._names
        named: dict[str, Any] = {}
        for ref, value in last.items():
            name = names.get(ref)
            if name is None:
                name = names[ref] = str(ref)
            named[name] = value
        return named

    def _close_scope(self, scope: Scope) -> None:
        for stream in scope.streams.values():
            self.peak_buffered = max(self.peak_buffered, stream.peak)
            stream.abandon()
            stream.closed = True

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


def _in_scope(ref: PortRef, scope: Scope) -> Any:
    """``ref``'s value fixed in ``scope`` or a scope around it (a loop's imports and carries, in
    the innermost loop first), or ``_UNKNOWN``."""
    search: Scope | None = scope
    while search is not None:
        fixed = search.fixed
        if ref in fixed:
            return fixed[ref]
        search = search.parent
    return _UNKNOWN


def _carry(
    carries: list[tuple[PortRef, tuple[PortRef, ...]]], last: Mapping[PortRef, Any]
) -> dict[PortRef, Any]:
    carried: dict[PortRef, Any] = {}
    for src, dsts in carries:
        if src not in last:
            raise RequestError(f"loop carry: {src} produced nothing this iteration")
        value = last[src]
        for dst in dsts:
            carried[dst] = value
    return carried
