"""The worker side of ``RemoteLauncher``: ``mstar worker --conductor tcp://HOST:PORT --rank N``.

The worker dials the launcher's control socket, asks to serve its rank (asking again every
second until the runtime is there to answer, so it may start first), and gets its
``WorkerConfig`` back: the model source, the engines of its rank, its batching limits. It
builds only a model source its own command line allows (``AllowedSources``: the zoo, or
builders named with ``--source``), never a ``module:function`` the runtime names. From then on
it is the same worker as a local one (``run_worker``: it builds its engines, dials the pool's
step socket and says ``Hello``), plus a heartbeat thread that keeps telling the launcher it is
alive and exits the process when the launcher stops answering, since a worker on another host
has no parent whose death it could follow.

With CURVE keys (``curve_keys``) every socket of the worker is authenticated and encrypted: it
talks only to a runtime holding the runtime's secret key. Without keys it joins a runtime on
this host only (a loopback address), as the runtime listens on nothing else without keys.

Exit status: 0 after the runtime's ``Shutdown``; 1 when the worker failed (a traceback is
logged); 2 when it could not join (refused, asked to build a source it does not allow, or
``join_timeout`` passed); 3 when the conductor went silent; 4 when the runtime told it to stop
(it killed the worker); 130 on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace

import zmq

from mstar_async.errors import MstarError, SourceRefused
from mstar_async.logs import get_logger
from mstar_async.transport import CurveKeys
from mstar_async.transport.secure import is_loopback, secure_client
from mstar_async.worker.control import (
    Beat,
    Bye,
    Join,
    Refuse,
    Stop,
    Welcome,
    decode_control,
    encode_control,
    split_tcp,
)
from mstar_async.worker.main import WorkerConfig, run_worker
from mstar_async.worker.sources import AllowedSources

__all__ = ["CONDUCTOR_LOST", "JOIN_FAILED", "STOPPED", "run_remote_worker"]

log = get_logger("mstar_async.worker.join")

JOIN_FAILED = 2
CONDUCTOR_LOST = 3
STOPPED = 4
_INTERRUPTED = 130
_RESEND_S = 1.0
_NOTICE_S = 30.0
_POLL_MS = 50


def _say(text: str) -> None:
    # What a user running the command must see whatever the log level.
    print(f"mstar worker: {text}", file=sys.stderr, flush=True)


def _join(
    sock: zmq.Socket[bytes], join: Join, conductor: str, join_timeout: float | None
) -> Welcome | Refuse | None:
    """Ask until answered; None when ``join_timeout`` passes first."""
    started = time.monotonic()
    next_send = next_notice = started
    pause = _POLL_MS / 1000  # doubling up to _RESEND_S: quick while the connection comes up
    while join_timeout is None or time.monotonic() - started < join_timeout:
        now = time.monotonic()
        if now >= next_send:
            try:
                sock.send(encode_control(join), zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected yet (IMMEDIATE): the next resend goes when it is
            next_send = now + pause
            pause = min(2 * pause, _RESEND_S)
        if now >= next_notice:
            _say(f"rank {join.rank}: waiting for the runtime at {conductor}")
            next_notice = now + _NOTICE_S
        if sock.poll(_POLL_MS):
            answer = decode_control(sock.recv())
            if isinstance(answer, Welcome | Refuse):
                return answer
    return None


class _Heartbeat(threading.Thread):
    """Beats to the launcher; ends this process when it stops answering or says stop."""

    def __init__(self, sock: zmq.Socket[bytes], nonce: str, welcome: Welcome, where: str) -> None:
        super().__init__(name="mstar-worker-heartbeat", daemon=True)
        self.sock = sock
        self.nonce = nonce
        self.interval = welcome.heartbeat
        self.timeout = welcome.timeout
        self.where = where
        self.done = threading.Event()

    def run(self) -> None:
        heard = next_beat = time.monotonic()
        while not self.done.is_set():
            now = time.monotonic()
            if now >= next_beat:
                try:
                    self.sock.send(encode_control(Beat(self.nonce)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected right now: the silence is what counts
                next_beat = now + self.interval
            if self.sock.poll(_POLL_MS):
                answer = decode_control(self.sock.recv())
                if isinstance(answer, Beat):
                    heard = time.monotonic()
                elif isinstance(answer, Stop):
                    _exit(STOPPED, f"the runtime at {self.where} told this worker to stop")
            if time.monotonic() - heard > self.timeout:
                _exit(
                    CONDUCTOR_LOST,
                    f"no answer from the runtime at {self.where} for {self.timeout:g} s: it "
                    "is gone (or the network is); exiting",
                )

    def stop(self) -> None:
        self.done.set()
        self.join()


def _exit(code: int, why: str) -> None:
    # From the heartbeat thread, whatever the main thread is doing (building engines, a long
    # forward): the worker holds nothing that outlives the process.
    _say(why)
    os._exit(code)


def run_remote_worker(
    conductor: str,
    rank: int,
    *,
    threads: int | None = None,
    log_level: str = "WARNING",
    join_timeout: float | None = None,
    curve_keys: CurveKeys | None = None,
    allowed: AllowedSources | None = None,
) -> int:
    """Join the runtime listening at ``conductor`` as ``rank`` and serve it until it shuts
    the worker down; returns the exit status (see the module doc). Blocks; runs its own event
    loop. ``threads`` is the torch thread count (default: what the runtime suggests, its own
    host's cores shared among its ranks: pass the cores this host gives the worker).
    ``curve_keys``: the key folder's keys (the worker keypair and the runtime's public key).
    ``allowed``: the model sources this worker builds (default: any zoo model).

    Raises:
        MstarError: ``conductor`` is not ``tcp://HOST:PORT``, or is not loopback and there are
            no ``curve_keys``.
        TransportError: ``curve_keys`` lack the worker's secret key.
        ValueError: ``rank`` is negative or ``threads`` below 1.
    """
    host, port = split_tcp(conductor, default_host="")
    if not host:
        raise ValueError(f"--conductor {conductor!r} names no host: write tcp://HOST:PORT")
    if rank < 0 or (threads is not None and threads < 1):
        raise ValueError(f"rank must be >= 0 and threads >= 1, got rank {rank}, threads {threads}")
    where = f"tcp://{host}:{port}"
    if curve_keys is None and not is_loopback(host):
        raise MstarError(
            f"refusing to join {where} without CURVE keys: anyone on the way could answer as "
            "the runtime. Pass --curve-keys DIR (or MSTAR_CURVE_KEYS=DIR) with the runtime's "
            "key folder (`mstar keys generate DIR` made it)"
        )
    client = curve_keys.runtime_client() if curve_keys is not None else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # Queue nothing while unconnected: resent joins would pile up and arrive all at once.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if client is not None:
        secure_client(sock, client)
    sock.connect(where)
    nonce = uuid.uuid4().hex
    try:
        join = Join(rank, nonce, os.getpid(), socket.gethostname())
        answer = _join(sock, join, where, join_timeout)
        if answer is None:
            _say(
                f"rank {rank}: no runtime answered at {where} within {join_timeout:g} s"
                f"{_key_hint(curve_keys)}"
            )
            return JOIN_FAILED
        if isinstance(answer, Refuse):
            _say(f"rank {rank} refused by the runtime at {where}: {answer.reason}")
            return JOIN_FAILED
        try:
            config = _accept(answer, allowed or AllowedSources(), host, curve_keys)
        except SourceRefused as exc:
            _say(f"rank {rank}: refusing what the runtime at {where} asked: {exc}")
            _goodbye(sock, Bye(nonce, JOIN_FAILED, f"SourceRefused: {exc}"))
            return JOIN_FAILED
        config = replace(config, threads=threads or config.threads, log_level=log_level)
        _say(f"rank {rank}: joined {where}; building engines {config.engines}")
        beats = _Heartbeat(sock, nonce, answer, where)
        beats.start()
        code, error = _serve(config)
        beats.stop()
        _goodbye(sock, Bye(nonce, code, error))
        _say(f"rank {rank}: exiting with status {code}")
        return code
    finally:
        sock.close()
        ctx.term()


def _accept(
    welcome: Welcome, allowed: AllowedSources, host: str, curve_keys: CurveKeys | None
) -> WorkerConfig:
    """The configuration this worker runs, from the one the runtime offered: the source
    checked before anything in it is imported, and what only this host knows put back.

    Raises:
        SourceRefused: the source is not allowed, or the configuration is malformed.
    """
    source = allowed.check(welcome.config.get("source"))
    try:
        offered = WorkerConfig(**welcome.config)
    except TypeError as exc:
        raise SourceRefused(f"the runtime sent a malformed worker configuration: {exc}") from None
    return replace(
        offered,
        source=source.to_dict(),
        endpoint=f"tcp://{welcome.data_host or host}:{welcome.data_port}",
        parent_pid=0,  # no parent to follow across hosts: the heartbeat does that job
        curve_keys=str(curve_keys.folder or "") if curve_keys is not None else "",
        curve_material={},
    )


def _key_hint(curve_keys: CurveKeys | None) -> str:
    # A runtime with other keys (or none) never completes the handshake: it looks like silence.
    if curve_keys is None:
        return " (this worker has no CURVE keys: a runtime that uses them never answers it)"
    return (
        f" (this worker uses the CURVE keys in {curve_keys.folder}: a runtime with other keys, "
        "or none, never answers it)"
    )


def _goodbye(sock: zmq.Socket[bytes], bye: Bye) -> None:
    sock.setsockopt(zmq.LINGER, 1000)  # let the goodbye out before the socket closes
    with contextlib.suppress(zmq.Again):  # no connection left: the runtime's timeout tells
        sock.send(encode_control(bye), zmq.NOBLOCK)


def _serve(config: WorkerConfig) -> tuple[int, str]:
    # SIGTERM (a supervisor stopping the worker) ends it like Ctrl-C: it says goodbye, so the
    # runtime knows at once instead of after a heartbeat timeout.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        return run_worker(config), ""
    except KeyboardInterrupt:
        return _INTERRUPTED, "interrupted (Ctrl-C or SIGTERM)"
    except Exception as exc:
        _say(f"rank {config.rank} failed:\n{traceback.format_exc()}")
        return 1, f"{type(exc).__name__}: {exc}"
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
