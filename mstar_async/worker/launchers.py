"""How ``WorkerPool`` starts a rank's worker: the ``Launcher`` seam and its two launchers.

A launcher turns a ``WorkerConfig`` into a running worker and hands back a ``WorkerHandle``
(wait for it to end, kill it). Whatever starts it, the worker is the same ``serve(config)``: it
connects a DEALER to the pool's ROUTER and step tensors travel over ZeroMQ, IPC on one host or
TCP across hosts. A launcher only places, starts and stops workers; it never carries a tensor.
Its ``curve_keys`` secure the TCP sockets: the pool binds with them and tells each worker the
key folder's path, where the worker (on its own host) loads them, or, for keys made for the
run (``CurveKeys.for_run``), the worker's keys themselves in its configuration.

- ``LocalLauncher`` (the default) runs each rank as a child process of this one.
- ``RayLauncher`` runs each rank as a Ray actor on an existing Ray cluster, in one placement
  group per pool (a bundle per rank: its CPUs, GPUs, custom resources; PACK or SPREAD). Ray is
  an optional extra (``pip install 'mstar-async[ray]'``); importing this module never imports
  it.
- ``RemoteLauncher`` (``mstar_async.worker.remote``) starts nothing: workers that users run on
  other hosts (``mstar worker``) join over plain TCP.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import anyio
from anyio.abc import Process

from mstar_async.errors import MstarError, WorkerLost
from mstar_async.logs import get_logger
from mstar_async.placement import STRATEGIES, Placement
from mstar_async.transport import CurveKeys
from mstar_async.worker.main import CONFIG_VARIABLE, WorkerConfig, run_worker
from mstar_async.worker.ray_group import RankGroup, bundle_of

__all__ = ["Launcher", "LocalLauncher", "RayLauncher", "WorkerHandle"]

log = get_logger("mstar_async.worker.launchers")

#: The exit code a handle reports for a worker that was killed (as ``kill -9`` reports it).
KILLED = -int(signal.SIGKILL)


class WorkerHandle(Protocol):
    """One started worker, as its launcher sees it."""

    @property
    def pid(self) -> int | None:
        """The worker's process id on its own host (None where the launcher cannot tell)."""
        ...

    @property
    def returncode(self) -> int | None:
        """The exit code once the worker has ended; None while it runs."""
        ...

    async def wait(self) -> int:
        """Return the exit code once the worker is gone. Cancel-safe; never raises."""
        ...

    def kill(self) -> None:
        """Stop the worker at once, without a clean shutdown. Idempotent; never raises."""
        ...


class Launcher(Protocol):
    """What starts ``WorkerPool``'s workers. A launcher serves one pool at a time: the pool
    calls ``open`` once on entry, ``start`` for every worker (restarts included) and ``aclose``
    once on exit.

    ``curve_keys`` are the CURVE keys of the TCP sockets between the pool and these workers,
    which load them from the same folder on their own hosts; None: no keys, so TCP stays on
    loopback addresses."""

    curve_keys: CurveKeys | None

    async def open(self) -> str | None:
        """Get ready to start workers, and say where they reach the pool.

        Returns None when every worker runs on this host (the pool then binds IPC), or the host
        name or IPv4 address workers connect to (the pool then binds a free TCP port on every
        interface and hands workers ``tcp://HOST:PORT``), or ``tcp://HOST:PORT`` to have the
        pool bind that port (on every interface) rather than a free one.
        """
        ...

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        """Start the worker ``config`` describes; return once it exists (not once it is ready:
        the worker says ``Hello`` over ZeroMQ when its engines are built).

        Raises:
            WorkerLost: the worker could not be started.
        """
        ...

    async def aclose(self) -> None:
        """Release what ``open`` and ``start`` acquired; kill workers still running.
        Never raises."""
        ...


# ---------------------------------------------------------------------------------- local


class _ProcessHandle:
    """A worker that is a child process of this one."""

    def __init__(self, process: Process) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def wait(self) -> int:
        return await self._process.wait()

    def kill(self) -> None:
        if self._process.returncode is None:
            try:
                self._process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended between the check and the signal; wait() reaps it


class LocalLauncher:
    """Each worker is ``python -m mstar_async.command worker`` (``mstar_async.worker.main``),
    a child process of this one, with its configuration in the environment variable
    ``MSTAR_WORKER_CONFIG``.

    With ``endpoint_host`` (e.g. ``"127.0.0.1"``) workers reach the pool over TCP at that
    address instead of IPC; the workers are still local, so this only exercises the TCP path.
    ``curve_keys`` secure that TCP (see ``Launcher``).
    """

    def __init__(
        self, *, endpoint_host: str | None = None, curve_keys: CurveKeys | None = None
    ) -> None:
        self.endpoint_host = endpoint_host
        self.curve_keys = curve_keys

    async def open(self) -> str | None:
        """Return ``endpoint_host``. Never raises."""
        return self.endpoint_host

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        """Start the worker process.

        Raises:
            OSError: the process could not be started.
        """
        env = {**os.environ, CONFIG_VARIABLE: config.to_json()}
        process = await anyio.open_process(
            [sys.executable, "-m", "mstar_async.command", "worker"],
            stdin=None,
            stdout=None,
            stderr=None,
            env=env,
        )
        return _ProcessHandle(process)

    async def aclose(self) -> None:
        """Nothing to release: the pool waits for or kills every process it started."""


# ------------------------------------------------------------------------------------ ray


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        MstarError: Ray is not installed (the message says what to install).
    """
    # Through importlib so that neither importing this module nor type-checking it needs Ray,
    # which ships incomplete types; everything Ray hands back is typed Any here.
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise MstarError(
            "RayLauncher needs Ray, which is not installed: pip install 'mstar-async[ray]'"
        ) from exc


def _consume(future: asyncio.Future[Any]) -> None:
    # A Ray result nobody awaits any more (its waiter was cancelled) must still be read, or
    # asyncio logs "exception was never retrieved" when it is collected.
    if not future.cancelled():
        future.exception()


def _watch(ref: Any) -> asyncio.Future[Any]:
    """An asyncio future that finishes with the Ray object ``ref``.

    Ray completes its ``concurrent.futures.Future`` from its own thread; ``wrap_future`` hands
    that over to the running loop thread-safely, which works on the default loop and on uvloop.
    """
    future = asyncio.wrap_future(ref.future())
    future.add_done_callback(_consume)
    return future


async def _until_done(future: asyncio.Future[Any]) -> None:
    # asyncio.wait never cancels what it waits on: cancelling this caller leaves the future
    # (and the Ray object behind it) alone, so a later waiter still gets its result.
    await asyncio.wait([future])


class _ActorHandle:
    """A worker running inside a Ray actor: it ends when the actor's ``run`` call finishes
    (the worker returned or raised) or the actor dies (killed, its node lost)."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any, name: str) -> None:
        self._ray = ray
        self.actor = actor
        self.name = name
        self._pid: int | None = None
        self.detail = ""  # why the worker ended, when it raised (the pool shows it)
        self._returncode: int | None = None
        self._killed = False
        self._done = _watch(run_ref)
        self._done.add_done_callback(self._finished)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def _finished(self, future: asyncio.Future[Any]) -> None:
        if self._returncode is not None:
            return
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or isinstance(error, self._ray.exceptions.RayActorError):
            self._returncode = KILLED
        elif error is not None:
            # serve() raised; Ray has already logged its traceback with the actor's output.
            self._returncode = 1
            cause = getattr(error, "cause", None) or error
            self.detail = f"{type(cause).__name__}: {cause}"
        else:
            self._returncode = int(future.result())
        # The actor outlives its method: end it so that its CPUs and GPUs go back to the
        # cluster (and a restarted rank can have them).
        self.kill()

    async def wait(self) -> int:
        await _until_done(self._done)
        self._finished(self._done)  # in case the done callback has not run yet
        assert self._returncode is not None
        return self._returncode

    def kill(self) -> None:
        if self._killed:
            return
        self._killed = True
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception as exc:
            # Best effort, as documented. Ray already disconnected? The cluster ends a
            # driver's actors when the driver goes.
            log.warning("worker.ray_kill_failed", actor=self.name, error=repr(exc))


def _run_in_actor(config_json: str, gpu_ids: list[str]) -> int:
    """The body of a Ray actor's ``run``: one worker, until ``Shutdown``. Returns 0.

    Raises:
        Whatever ``serve`` raises (Ray hands it to the pool as the actor call's error).
    """
    if gpu_ids:
        # Ray reserved these GPUs for the actor. Set before torch first touches CUDA, so the
        # rank sees only its own devices and "cuda:0" is the first of them.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    config = WorkerConfig.from_json(config_json)
    # The pool's pid means nothing on another host. An actor's parent is its node's raylet:
    # watching that ends the worker if Ray goes away under it (the pool, through Ray, ends it
    # in every other case).
    return run_worker(replace(config, parent_pid=os.getppid()))


def _actor_class(ray: Any) -> Any:
    # Defined here, not at module level, so that importing this module never needs Ray. Ray
    # ships the class to the actor process by value; it imports this module (and torch) only
    # in run(), so the actor answers pid() as soon as its process is up.
    class MstarWorker:
        """One rank's worker, in its own Ray actor process."""

        def pid(self) -> int:
            return os.getpid()

        def run(self, config_json: str) -> int:
            from mstar_async.worker.launchers import _run_in_actor

            gpu_ids = [str(i) for i in ray.get_gpu_ids()]
            return _run_in_actor(config_json, gpu_ids)

    return ray.remote(MstarWorker)


class RayLauncher:
    """Each worker is a Ray actor on an existing Ray cluster, placed by Ray where the rank's
    resources are free.

    ``address`` is the cluster to join (``"auto"``: the one ``ray start`` runs on this host;
    ``"HOST:6379"``; None: whatever ``ray.init()`` finds, or a new local one). When Ray is
    already initialized in this process it is used as it is, and ``address`` is ignored: call
    ``ray.init`` yourself first for options this class does not take (``runtime_env``,
    ``namespace``, ...).

    Each rank asks Ray for ``num_cpus_per_rank`` CPUs and ``num_gpus_per_rank`` GPUs, or for
    what ``resources_per_rank[rank]`` says: Ray's resource names, ``"CPU"``, ``"GPU"``,
    ``"memory"`` (bytes) and custom ones, e.g. ``{1: {"GPU": 1, "node:10.0.0.2": 0.01}}`` pins
    rank 1 to that node. A rank's torch thread count is its CPU count. The ranks' resources are
    reserved together, as one Ray placement group per pool (bundle ``i``: rank ``i``'s
    resources) with ``strategy`` (one of ``STRATEGIES``: PACK, the default, puts the ranks on
    as few nodes as fit them, SPREAD on as many), made at the pool's first start and removed
    on ``aclose``; each rank's actor runs in its bundle. When a node dies, Ray moves its
    bundles to a live node that fits them, and the rank the pool restarts runs there.
    ``for_placement`` takes the resources and strategy from a ``Placement``. A GPU rank sees
    only the GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``): ``cuda:0`` there is the first of its own.

    Workers connect to the pool over ZeroMQ TCP at ``endpoint_host`` (default: this node's
    address as Ray knows it), which every node must be able to reach. Tensors never go through
    Ray's object store. That TCP needs ``curve_keys`` unless ``endpoint_host`` is loopback (a
    one-node cluster): each node must hold the key folder at the same path.

    ``start_timeout`` bounds how long joining the cluster, reserving the ranks' resources, and
    placing and starting one actor, may take (Ray would wait forever for a cluster that is
    gone, or for resources none of its nodes has); a rank's restart waits for Ray unbounded.

    Not for the trio backend: it waits on Ray's futures through asyncio (default loop or
    uvloop), like the rest of the runtime.

    Raises:
        MstarError: Ray is not installed.
        ValueError: a negative resource amount, a non-positive ``start_timeout``, or an unknown
            ``strategy``.
    """

    def __init__(
        self,
        address: str | None = "auto",
        *,
        resources_per_rank: Mapping[int, Mapping[str, float]] | None = None,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float = 0,
        endpoint_host: str | None = None,
        start_timeout: float = 120.0,
        curve_keys: CurveKeys | None = None,
        strategy: str = "PACK",
    ) -> None:
        self._ray = import_ray()
        self.curve_keys = curve_keys
        self.address = address
        self.resources_per_rank = {
            rank: dict(request) for rank, request in (resources_per_rank or {}).items()
        }
        self.num_cpus_per_rank = num_cpus_per_rank
        self.num_gpus_per_rank = num_gpus_per_rank
        self.endpoint_host = endpoint_host
        self.start_timeout = start_timeout
        for rank in self.resources_per_rank:
            for name, amount in self.resources_for(rank).items():
                if amount < 0:
                    raise ValueError(f"rank {rank} asks for {amount} of {name!r}: must be >= 0")
        if num_cpus_per_rank < 0 or num_gpus_per_rank < 0:
            raise ValueError("num_cpus_per_rank and num_gpus_per_rank must be >= 0")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0, got {start_timeout}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.strategy = strategy
        self._group: RankGroup | None = None
        self._reserving = anyio.Lock()
        self._owns_ray = False
        self._actor: Any = None
        self._handles: list[_ActorHandle] = []
        self._names = itertools.count()
        self._token = uuid.uuid4().hex[:8]

    @classmethod
    def for_placement(
        cls, placement: Placement, address: str | None = "auto", **options: Any
    ) -> RayLauncher:
        """A launcher for ``placement``'s ranks: its ``resources`` per rank (one CPU where it
        says none) and its ``strategy``; ``options`` are the other keywords of ``RayLauncher``
        (``curve_keys``, ``endpoint_host``, ``start_timeout``).

        Raises:
            MstarError: Ray is not installed.
            ValueError: as ``RayLauncher``.
        """
        return cls(
            address,
            resources_per_rank={r: placement.resources_for(r) for r in range(placement.ranks)},
            num_cpus_per_rank=0,
            strategy=placement.strategy,
            **options,
        )

    def resources_for(self, rank: int) -> dict[str, float]:
        """What ``rank``'s actor asks Ray for, by Ray's resource names. Never raises."""
        return {
            "CPU": self.num_cpus_per_rank,
            "GPU": self.num_gpus_per_rank,
            **self.resources_per_rank.get(rank, {}),
        }

    async def open(self) -> str:
        """Join the Ray cluster (unless Ray is already initialized in this process) and return
        the address workers reach the pool at.

        ``ray.init`` runs in a worker thread, so the event loop keeps running, and Ray installs
        no SIGTERM handler of its own in the host process (it logs that it did not). The join
        may take ``start_timeout`` seconds. Cancel-safe: a cancelled (or timed out) join goes
        on in its thread, which cannot be stopped, and stays connected until this process
        exits; only a join that completed is left again by ``aclose``.

        Raises:
            MstarError: no Ray cluster answers at ``address`` (in time).
        """
        ray = self._ray
        if not ray.is_initialized():
            try:
                with anyio.fail_after(self.start_timeout):
                    await anyio.to_thread.run_sync(
                        partial(ray.init, address=self.address), abandon_on_cancel=True
                    )
            except TimeoutError:
                raise MstarError(
                    f"no answer from a Ray cluster at {self.address!r} within "
                    f'{self.start_timeout} s: is it running? ("auto" follows '
                    "/tmp/ray/ray_current_cluster, which a cluster that did not stop cleanly "
                    "leaves behind: `ray stop` clears it)"
                ) from None
            except ConnectionError as exc:
                raise MstarError(
                    f"no Ray cluster at {self.address!r} ({exc}): start one with "
                    "`ray start --head`, or pass its address"
                ) from exc
            self._owns_ray = True
        host: str = self.endpoint_host or ray.util.get_node_ip_address()
        return host

    async def _reserve(self, ranks: int) -> RankGroup:
        """The pool's placement group, reserved on the first call (bundle ``i``: rank ``i``).

        Raises:
            WorkerLost: Ray did not reserve the bundles within ``start_timeout``.
        """
        async with self._reserving:
            if self._group is None:
                bundles = [bundle_of(self.resources_for(rank)) for rank in range(ranks)]
                self._group = await RankGroup.reserve(
                    self._ray, bundles, self.strategy, f"mstar-{self._token}", self.start_timeout
                )
            return self._group

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        """Create the rank's actor in its bundle of the pool's placement group (reserved on the
        first start, for ``config.ranks`` ranks) and start the worker in it; return once the
        actor runs.

        Cancel-safe: a start cancelled before the actor runs kills the actor.

        A restart (``config.generation`` above 1) waits with no bound for Ray to start the
        actor: after a node is lost, the rank's bundle waits for a node that fits it, which may
        join later; the pool reports the rank as restarting meanwhile.

        Raises:
            WorkerLost: Ray did not reserve the ranks' resources, or start the actor of a first
                start, within ``start_timeout`` (no node has them free), or the actor died while
                starting.
        """
        ray = self._ray
        if self._actor is None:
            self._actor = _actor_class(ray)
        group = await self._reserve(max(config.ranks, config.rank + 1))
        request = self.resources_for(config.rank)
        options: dict[str, Any] = {
            "scheduling_strategy": group.strategy_for(config.rank),
            "num_cpus": request.pop("CPU"),
            "num_gpus": request.pop("GPU"),
            # The pool restarts a dead rank with a new generation and identity; a Ray restart
            # would bring back the old one, which the pool no longer listens to.
            "max_restarts": 0,
            "name": f"mstar-{self._token}-{next(self._names)}-rank{config.rank}",
        }
        if "memory" in request:
            options["memory"] = request.pop("memory")
        if request:
            options["resources"] = request
        # Ray sizes a worker's thread pools by its CPU request; torch's share follows suit.
        config = replace(config, threads=max(1, int(options["num_cpus"])))
        actor = self._actor.options(**options).remote()
        pid_ref = actor.pid.remote()  # an actor runs its calls in order: pid, then run
        run_ref = actor.run.remote(config.to_json())
        handle = _ActorHandle(ray, actor, run_ref, options["name"])
        self._handles = [h for h in self._handles if h.returncode is None] + [handle]
        pid = _watch(pid_ref)
        # A first start is bounded; a restart waits for Ray as long as it takes: the rank's
        # bundle may be waiting for a node that fits it to join (its node was lost).
        bound = self.start_timeout if config.generation <= 1 else None
        try:
            with anyio.fail_after(bound):
                await _until_done(pid)
            handle._pid = int(pid.result())
        except TimeoutError:
            handle.kill()
            raise WorkerLost(
                f"Ray did not start worker rank {config.rank} within {self.start_timeout} s: "
                f"does a node have {self.resources_for(config.rank)} free?"
            ) from None
        except ray.exceptions.RayError as exc:
            handle.kill()
            raise WorkerLost(f"the Ray actor of worker rank {config.rank} died: {exc}") from exc
        except BaseException:
            handle.kill()
            raise
        log.info("worker.ray_actor", rank=config.rank, actor=handle.name, pid=handle.pid)
        return handle

    async def aclose(self) -> None:
        """Kill the actors still running, remove the placement group; leave the cluster if
        ``open`` joined it.

        Never raises.
        """
        for handle in self._handles:
            handle.kill()
        self._handles = []
        if self._group is not None:
            self._group.remove()
            self._group = None
        if self._owns_ray:
            self._owns_ray = False
            try:
                await anyio.to_thread.run_sync(self._ray.shutdown)
            except Exception as exc:
                # Closing must not fail the runtime's exit; the connection ends with the process.
                log.warning("worker.ray_shutdown_failed", error=repr(exc))
