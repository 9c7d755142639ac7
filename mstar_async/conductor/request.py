"""Per-request state and the API a request program uses to run walks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, cast

import anyio
from anyio.abc import TaskGroup

from mstar_async.conductor.executor import ReplicaPinner, StepExecutor
from mstar_async.conductor.metrics import RequestMetrics
from mstar_async.conductor.walk_stream import WalkHost, WalkStream
from mstar_async.errors import WalkInputError
from mstar_async.graph import Model, PortRef, WalkPlan


class _Closable(Protocol):
    @property
    def closed(self) -> bool: ...


class RequestContext:
    """One request's state: its id, values persisted between walks, and its open channels.

    A request program receives this as its first argument and runs walks through ``run`` and
    ``stream``. Not shared between requests.
    """

    def __init__(
        self,
        request_id: str,
        model: Model,
        executor: StepExecutor,
        task_group: TaskGroup,
        *,
        walks: WalkHost,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.executor = executor
        self.walks = walks
        #: The walks this request started (cancelled when it ends, however it ends).
        self.walk_streams: list[WalkStream] = []
        self.metrics = metrics if metrics is not None else RequestMetrics(request_id)
        self.persisted: dict[PortRef, Any] = {}
        self._task_group = task_group
        self._channels: list[Any] = []
        #: Whether a task was started in the request's task group (by it or a replica's run).
        self.spawned = False
        self._root = self

    def record_usage(
        self, *, prompt_tokens: int | None = None, completion_tokens: int | None = None
    ) -> None:
        """Report the request's token counts for its metrics (a later report replaces one).

        Raises:
            ValueError: a count is negative.
        """
        self.metrics.record_usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    def track(self, *ends: Any) -> None:
        """Remember channel ends so the request closes them all when it ends, however it ends."""
        self._channels.extend(ends)

    @property
    def channels(self) -> list[_Closable]:
        """Every channel end this request opened (for leak checks: all ``closed`` once it ends)."""
        return list(self._channels)

    def close_channels(self, *, keep: Any = None) -> None:
        """Close every channel end this request opened but ``keep``; idempotent."""
        for end in self._channels:
            if end is keep:
                continue
            close = getattr(end, "close_now", None) or end.close
            close()

    def stream(
        self, walk: str, params: Mapping[str, Any] | None = None, **inputs: Any
    ) -> WalkStream:
        """Start walk ``walk`` and iterate its outputs as they are made.

        ``inputs`` feed the walk's free input ports, by ``port`` (every free port of that name)
        or ``"node.port"``; ``params`` reach loop bounds and ``DynamicLoop.until``. Use it as
        ``async with request.stream(...) as events: async for event in events: ...``.

        Raises:
            GraphError: the model has no such walk.
            WalkInputError: an input names no free input port of the walk.
        """
        plan = self.model.plan(walk)
        bound, bound_params = _bind_inputs(plan, inputs), dict(params or {})
        _check_streams(plan, bound)
        return WalkStream(self, self.walks, plan, bound, bound_params)

    def start_soon(self, func: Any, *args: Any) -> None:
        """Run ``func(*args)`` in the request's task group (cancelled with the request)."""
        self._root.spawned = True
        self._task_group.start_soon(func, *args)

    def cancel_walks(self) -> None:
        """Stop every walk of this request that still runs (no wait); idempotent."""
        for walk in self.walk_streams:
            walk.cancel()

    async def run(
        self, walk: str, params: Mapping[str, Any] | None = None, **inputs: Any
    ) -> WalkResult:
        """Run walk ``walk`` to the end and return the last value of each of its outputs.

        Cancel-safe: cancelling stops the walk and closes its channels.

        Raises:
            GraphError, WalkInputError: as ``stream``.
            RequestError, EngineError: a step failed.
        """
        last: dict[str, Any] = {}
        async with self.stream(walk, params, **inputs) as events:
            async for event in events:
                last[event.port] = event.value
        return WalkResult(last)

    async def run_on_replicas(
        self, walk: str, params: Mapping[str, Any] | None = None, **inputs: Any
    ) -> list[WalkResult]:
        """Run walk ``walk`` once on every replica of the engines it uses, and return each
        run's outputs (as ``run``'s, by replica number).

        For work on what each replica keeps beyond one request, which a routed request would
        do on one replica only: dropping a KV handle every replica may hold (a deleted voice).
        When the executor replicates an engine of the walk over N ranks, the walk runs N times
        at once (N: the most replicas any of its engines has), run ``i`` on replica ``i`` of
        each (modulo its count); otherwise (no replicas, or engines in this process) it runs
        once, as ``run``. Each replica's run is a request of its own to the executor
        (``<request id>@<i>``), released when it ends, however it ends; it sees the values
        this request persisted so far, and what it persists is not kept (every replica would
        make its own). Every run goes to its end even when another fails.

        Cancel-safe: cancelling stops every run and releases each on its ranks.

        Raises:
            GraphError: the model has no such walk.
            WalkInputError: an input names no free input port of the walk, or the walk takes
                a streamed input (one stream cannot feed several runs).
            RequestError, EngineError: a run failed (the first failure, by replica number).
        """
        plan = self.model.plan(walk)
        if plan.input_streams:
            raise WalkInputError(
                f"walk {walk!r} takes a streamed input, so it cannot run on every replica"
            )
        pinner = self.executor if isinstance(self.executor, ReplicaPinner) else None
        count = 1 if pinner is None else pinner.replica_count(plan)
        if pinner is None or count == 1:
            return [await self.run(walk, params, **inputs)]
        _bind_inputs(plan, inputs)  # a bad input fails here, not once per replica
        outcomes: dict[int, WalkResult | Exception] = {}

        async def run_on(replica: int) -> None:
            request = self._replica(replica)
            try:
                pinner.pin_replica(request.request_id, plan, replica)
                outcomes[replica] = await request.run(walk, params, **inputs)
            except Exception as exc:  # the other replicas' runs go on
                outcomes[replica] = exc
            finally:
                await self.executor.release(request.request_id)

        async with anyio.create_task_group() as runs:
            for replica in range(count):
                runs.start_soon(run_on, replica)
        results = [outcomes[replica] for replica in range(count)]
        for outcome in results:
            if isinstance(outcome, Exception):
                raise outcome
        return cast("list[WalkResult]", results)

    def _replica(self, replica: int) -> RequestContext:
        """The request that runs a walk on replica ``replica`` for this one."""
        request = RequestContext(
            f"{self.request_id}@{replica}",
            self.model,
            self.executor,
            self._task_group,
            walks=self.walks,
            metrics=self.metrics,
        )
        request.persisted = dict(self.persisted)
        request._root = self._root
        return request


def _check_streams(plan: WalkPlan, bound: Mapping[PortRef, Any]) -> None:
    """Streamed walk inputs need an async iterable each."""
    for ref in plan.input_streams:
        if ref not in bound:
            raise WalkInputError(
                f"walk {plan.walk.name!r} takes {ref} as a stream; pass {ref.port}=<an async "
                "iterable of items> when you run it"
            )
        if not hasattr(bound[ref], "__aiter__"):
            raise WalkInputError(
                f"walk {plan.walk.name!r}: input {ref} is a stream; pass an async iterable of "
                f"items (lists, or tensors whose dim 0 is the item axis), got "
                f"{type(bound[ref]).__name__}"
            )


def _bind_inputs(plan: WalkPlan, inputs: Mapping[str, Any]) -> dict[PortRef, Any]:
    bound: dict[PortRef, Any] = {}
    for key, value in inputs.items():
        if "." in key:
            ref = PortRef.parse(key, role="walk input")
            matches = [ref] if ref in plan.input_ports else []
        else:
            matches = [ref for ref in plan.input_ports if ref.port == key]
        if not matches:
            names = sorted({r.port for r in plan.input_ports} | {str(r) for r in plan.input_ports})
            raise WalkInputError(
                f"walk {plan.walk.name!r} takes no input {key!r}; its inputs are {names}"
            )
        for ref in matches:
            bound[ref] = value
    return bound


class WalkResult(Mapping[str, Any]):
    """The outputs of a finished walk, by ``"node.port"`` or by bare port name when unique."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values
        self._by_port: dict[str, list[str]] = {}
        for key in values:
            self._by_port.setdefault(key.split(".", 1)[1], []).append(key)

    def __getitem__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        full = self._by_port.get(key, [])
        if len(full) == 1:
            return self._values[full[0]]
        if full:
            raise KeyError(f"{key!r} is ambiguous: use one of {full}")
        raise KeyError(f"no output {key!r}; outputs: {sorted(self._values)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)
