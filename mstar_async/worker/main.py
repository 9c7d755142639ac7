"""The worker process: ``python -m mstar_async.command worker`` (this module's ``main``, see
``mstar_async.command``) with its configuration in the environment variable
``MSTAR_WORKER_CONFIG`` (JSON, written by ``WorkerPool``).

It rebuilds the model from its source, builds the engines its rank runs, connects to the
conductor, says ``Hello``, and runs the walks the conductor starts through its own batching loop
until told to shut down, or until its parent is gone.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from mstar_async.graph import ModelSource
from mstar_async.logs import configure_logging, get_logger
from mstar_async.transport import (
    CurveKeys,
    FeedWalk,
    Hello,
    Link,
    Peers,
    Ping,
    Pong,
    Release,
    Shutdown,
    StartWalk,
    WalkCredit,
    ZmqHub,
)
from mstar_async.worker.lifecycle import die_with_parent, ignore_interrupts, watch_parent
from mstar_async.worker.report import loop_report
from mstar_async.worker.state_moves import StateMoves
from mstar_async.worker.tensor_links import WorkerTensors, bind_peer_endpoint
from mstar_async.worker.tensor_store import TensorStore
from mstar_async.worker.walk_loop import WalkLoop, build_engines
from mstar_async.worker.walk_service import WalkService
from mstar_async.worker.wire_types import register_wire_types

CONFIG_VARIABLE = "MSTAR_WORKER_CONFIG"
log = get_logger("mstar_async.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs to start: its rank, where the conductor listens, how to
    rebuild the model, which engines to build, and its share of the CPU. ``parent_pid`` is the
    process whose end ends the worker; 0 for none (a worker on another host). ``curve_keys``
    is the CURVE key folder on the worker's host, for its TCP sockets (empty: no keys; the
    folder's path, never a key, is what travels); ``curve_material``, when set instead, is the
    worker's keys themselves (``CurveKeys.worker_material``: keys made for one run, which the
    runtime hands the workers it starts, e.g. Ray actors on hosts without a key folder).
    ``ranks`` is how many ranks the pool runs (0 to ``ranks - 1``): a launcher that reserves
    them together (Ray's placement group) sizes its reservation by it."""

    rank: int
    generation: int
    endpoint: str
    source: dict[str, Any]
    engines: list[str]
    parent_pid: int
    threads: int = 1
    max_batch_size: int = 256
    max_batch_tokens: int = 512
    forward_time_bound_s: float = 0.1
    log_level: str = "WARNING"
    curve_keys: str = ""
    curve_material: dict[str, str] = field(default_factory=dict)
    ranks: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The configuration as the JSON the environment variable carries."""
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        """Parse ``to_json``'s output.

        Raises:
            ValueError: the text is not such a configuration.
        """
        try:
            return cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad worker configuration: {exc}") from exc


def identity(rank: int, generation: int) -> bytes:
    """The ZeroMQ identity of a worker: one per process, so a restarted rank is a new peer."""
    return f"rank-{rank}-{generation}".encode()


def check_paths(config: WorkerConfig) -> None:
    """Check that every builder option naming a file (``path``, ``snac_path``: any option whose
    name ends in ``path``) exists on this host: a worker reads a checkpoint at the path the
    runtime was given, on its own node.

    Raises:
        FileNotFoundError: one does not; the message names the path, the rank and this host.
    """
    options = config.source.get("options", {})
    for name, value in options.items():
        if name.endswith("path") and isinstance(value, str) and value and not os.path.exists(value):
            raise FileNotFoundError(
                f"worker rank {config.rank} on host {socket.gethostname()}: no {name} {value} "
                "here; every rank reads the checkpoint at that same path on its own node: copy "
                "it there (or mount it at that path)"
            )


def worker_keys(config: WorkerConfig) -> CurveKeys | None:
    """The CURVE keys ``config`` gives: its key material, else its key folder, else none.

    Raises:
        TransportError: the material is malformed, or the folder cannot be loaded.
    """
    if config.curve_material:
        return CurveKeys.from_material(config.curve_material)
    return CurveKeys.load(config.curve_keys) if config.curve_keys else None


async def serve(config: WorkerConfig) -> None:
    """Run the worker until ``Shutdown``, or until the parent process is gone.

    Raises:
        TransportError: the CURVE keys ``config`` names cannot be loaded.
        FileNotFoundError: a checkpoint path of the model's options is not on this host.
        Whatever building the model or an engine raises (the process then exits non-zero and
        the pool reports it).
    """
    register_wire_types()
    keys = worker_keys(config)
    check_paths(config)
    model = ModelSource(**config.source).build()
    thread, engines = await build_engines({name: model.components[name] for name in config.engines})
    batching = WalkLoop(
        engines,
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        forward_time_bound_s=config.forward_time_bound_s,
        forward_thread=thread,
    )
    with ZmqHub() as hub:
        link = hub.connect(
            config.endpoint,
            identity=identity(config.rank, config.generation),
            curve=keys.runtime_client() if keys is not None else None,
        )
        peer_server, peer_endpoint = bind_peer_endpoint(hub, config.endpoint, keys)
        tensors = WorkerTensors(hub, TensorStore(config.rank, config.generation), keys)
        states = StateMoves(batching, tensors)
        walks = WalkService(model, batching, link, tensors, states)
        async with anyio.create_task_group() as tg:
            await tg.start(batching.run)
            await tg.start(walks.serve)
            if config.parent_pid > 0:
                tg.start_soon(_stop_with_parent, config.parent_pid, tg.cancel_scope)
            tg.start_soon(tensors.serve, peer_server, walks.from_peer, states)
            hello = Hello(config.rank, os.getpid(), config.endpoint, sorted(engines), peer_endpoint)
            await link.send(hello)
            log.info("worker.ready", rank=config.rank, engines=sorted(engines))
            await _serve_messages(link, batching, tensors, walks, tg)
            tg.cancel_scope.cancel()


async def _serve_messages(
    link: Link, batching: WalkLoop, tensors: WorkerTensors, walks: WalkService, tg: Any
) -> None:
    # Everything the conductor sends a worker: walks (starts, feeds, credit and cancels),
    # releases, the peers' endpoints, stats probes and the shutdown. Steps never come one by
    # one: a walk's steps run here, inside it.
    while True:
        message = await link.recv()
        if isinstance(message, WalkCredit):
            walks.credit(message)
        elif isinstance(message, FeedWalk):
            walks.feed(message)
        elif isinstance(message, StartWalk):
            walks.begin(message)
            walks.start(message)
        elif isinstance(message, Release):
            walks.cancel_request(message.request_id)  # first: an ending walk may keep tensors
            tensors.store.release(message.request_id)
            tg.start_soon(batching.release, message.request_id)
        elif isinstance(message, Peers):
            tensors.set_peers(message.endpoints)
            walks.wake()  # what waited for a peer's endpoint can go now
        elif isinstance(message, Ping):
            stats = {
                **tensors.stats(),
                **loop_report(batching),
                **walks.peer_stats(),
                **walks.states.stats(),
            }
            await link.send(Pong(message.id, stats))
        elif isinstance(message, Shutdown):
            return


async def _stop_with_parent(parent_pid: int, scope: anyio.CancelScope) -> None:
    await watch_parent(parent_pid)
    scope.cancel()


def main() -> int:
    """Entry point of a worker process; returns its exit status."""
    die_with_parent()
    ignore_interrupts()
    return run_worker(WorkerConfig.from_json(os.environ[CONFIG_VARIABLE]))


def run_worker(config: WorkerConfig) -> int:
    """Serve as a worker on a new event loop in this thread (uvloop when installed); returns
    the exit status once the worker stops.

    Raises:
        Whatever ``serve`` raises.
    """
    configure_logging(config.log_level)
    torch.set_num_threads(max(1, config.threads))
    try:
        import uvloop  # noqa: F401
    except ImportError:
        anyio.run(serve, config)
    else:
        anyio.run(serve, config, backend_options={"use_uvloop": True})
    return 0
