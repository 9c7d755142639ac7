"""``mstar bench soak``: a server under a mixed load for minutes, watched for leaks and drift.

The served app (``create_app``, as ``mstar serve`` builds it) runs on uvicorn in this process;
``clients`` concurrent clients on the same event loop send, until the time is up, a random mix
(seeded) of: short completions (their latency is measured), whole streamed completions,
streams the client drops after the first event, speech requests when a speech model is
served, and malformed bodies (which must get a 4xx). Every ``sample_s`` seconds a sample
records this process's RSS and open file descriptors (worker processes' RSS added), the KV
blocks in use, files in ``/dev/shm``, requests done and failed, and the short requests' latency
in that window. After the load stops, the server must settle: no request in flight, no KV block
held, file descriptors back to where they started (a few of slack for the client's pool).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from mstar_async.bench.common import ProgressLog, free_port, machine_info, percentile
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.errors import MstarError
from mstar_async.loop import run_async

Progress = Callable[[str], None]

#: How long the server may take, after the load, to drop every request and KV block.
SETTLE_S = 10.0
#: File descriptors the settled server may hold beyond its start (client pool, log files).
FD_SLACK = 8
SPEECH_MODELS = ("orpheus", "qwen3-omni")


class SoakError(MstarError):
    """The soak could not run (a model failed to build, the server did not start)."""


@dataclass(frozen=True)
class SoakConfig:
    """What to serve and for how long.

    Raises:
        ValueError: a duration or count is out of range.
    """

    minutes: float = 5.0
    sample_s: float = 10.0
    clients: int = 8
    models: tuple[str, ...] = ("causal-lm", "orpheus")
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.minutes <= 24 * 60 or not 0.5 <= self.sample_s <= 600:
            raise ValueError(
                f"minutes must be in (0, 1440] and sample_s in [0.5, 600], got {self.minutes} "
                f"and {self.sample_s}"
            )
        if not 1 <= self.clients <= 256 or not self.models:
            raise ValueError(f"clients must be in [1, 256] and models not empty, got {self}")


def preset(quick: bool) -> SoakConfig:
    """The default soak, or with ``quick`` a few seconds of the demo model (for checks)."""
    if quick:
        return SoakConfig(minutes=0.1, sample_s=1.0, clients=2, models=("demo",))
    return SoakConfig()


@dataclass
class _Window:
    done: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    """One look at the server: time since the start, memory, descriptors, KV, traffic."""

    t_s: float
    rss_mb: float
    fds: int
    kv_blocks: int
    shm_files: int
    in_flight: int
    done: int
    failed: int
    p50_ms: float | None
    p99_ms: float | None


# --------------------------------------------------------------------------- what is measured


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _shm_files() -> int:
    try:
        return len(os.listdir("/dev/shm"))
    except OSError:
        return 0


class _Watch:
    """Reads the served models' state from the app (in process) or its workers."""

    def __init__(self, app: Any) -> None:
        self.models = app.state.server.models

    def in_flight(self) -> int:
        return sum(served.admission.in_flight for served in self.models.values())

    async def kv_blocks(self) -> int:
        total = 0
        for served in self.models.values():
            stats = await served.runtime.stats()
            total += sum(rank.kv_used for rank in stats.ranks.values())
        return total

    def rss_mb(self) -> float:
        pids = [os.getpid()]
        for served in self.models.values():
            pool = served.runtime.pool
            if pool is not None:
                pids += [p for p in (pool.pid(rank) for rank in pool.ranks) if p is not None]
        return sum(_rss_mb(pid) for pid in pids)


# --------------------------------------------------------------------------- the load


def _requests(models: Sequence[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, path, body) of each request the clients pick from."""
    text = "causal-lm" if "causal-lm" in models else None
    speech = next((m for m in models if m in SPEECH_MODELS), None)
    out: list[tuple[str, str, dict[str, Any]]] = []
    if text:
        out += [
            ("short", "/v1/completions", {"model": text, "prompt": "Hello", "max_tokens": 4}),
            (
                "stream",
                "/v1/completions",
                {"model": text, "prompt": "Once", "max_tokens": 32, "stream": True},
            ),
            (
                "drop",
                "/v1/completions",
                {"model": text, "prompt": "Twice", "max_tokens": 512, "stream": True},
            ),
        ]
    if speech:
        out.append(
            (
                "speech",
                "/v1/audio/speech",
                {"model": speech, "input": "Hi there.", "max_tokens": 40},
            )
        )
    out.append(("malformed", "/v1/completions", {"model": models[0], "max_tokens": "many"}))
    if not out[:-1]:
        out.append(("short", "/generate", {"model": models[0], "inputs": {}}))
    return out


def _one(host: str, port: int, kind: str, path: str, body: dict[str, Any]) -> None:
    """One request on its own connection (the standard library's client: no dependency).

    Raises:
        SoakError: an unexpected status (a 4xx for a malformed body is expected).
        OSError, http.client.HTTPException: the connection failed.
    """
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if kind == "malformed":
            if not 400 <= reply.status < 500:
                raise SoakError(f"a malformed body got {reply.status}, not a 4xx")
            reply.read()
            return
        if reply.status != 200:
            raise SoakError(f"{path} answered {reply.status}: {reply.read()[:200]!r}")
        if kind == "drop":
            reply.readline()  # then leave mid-stream: the server must cancel the request
            return
        reply.read()
    finally:
        conn.close()


def _client(
    url: str,
    work: Sequence[tuple[str, str, dict[str, Any]]],
    until: float,
    seed: int,
    windows: _Windows,
) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    pick = random.Random(seed)
    while time.monotonic() < until:
        kind, path, body = pick.choice(work)
        started = time.perf_counter()
        try:
            _one(host, port, kind, path, body)
        except (OSError, http.client.HTTPException, SoakError) as exc:
            windows.record(kind, None, f"{kind}: {exc!r}"[:200])
            continue
        windows.record(kind, time.perf_counter() - started, None)


class _Windows:
    """The current window of results, shared by the client threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = _Window()

    def record(self, kind: str, seconds: float | None, failure: str | None) -> None:
        with self._lock:
            window = self._current
            if failure is not None:
                window.failed += 1
                window.failures.append(failure)
                return
            window.done += 1
            if kind == "short" and seconds is not None:
                window.latencies.append(seconds)

    def take(self) -> _Window:
        with self._lock:
            window, self._current = self._current, _Window()
            return window


# --------------------------------------------------------------------------- running


def _server(app: Any, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="on", access_log=False, log_level="warning"
    )
    return uvicorn.Server(config)


async def _sample(watch: _Watch, started: float, window: _Window) -> Sample:
    lat = sorted(window.latencies)
    return Sample(
        t_s=round(time.monotonic() - started, 1),
        rss_mb=round(watch.rss_mb(), 1),
        fds=_fds(),
        kv_blocks=await watch.kv_blocks(),
        shm_files=_shm_files(),
        in_flight=watch.in_flight(),
        done=window.done,
        failed=window.failed,
        p50_ms=round(1000 * percentile(lat, 50), 1) if lat else None,
        p99_ms=round(1000 * percentile(lat, 99), 1) if lat else None,
    )


async def run_soak(config: SoakConfig, progress: Progress) -> dict[str, Any]:
    """Serve ``config.models`` under the mixed load for ``config.minutes``; return the report
    (samples, the settled state, whether it leaked). Progress: a line per sample.

    Raises:
        SoakError: a model failed to build or the server did not start.
    """
    from mstar_async.models import build_model
    from mstar_async.server import ModelSpec, create_app

    try:
        specs = [ModelSpec(build_model(name)) for name in config.models]
    except (MstarError, ValueError, OSError) as exc:
        raise SoakError(f"cannot build the models: {exc}") from exc
    app = create_app(specs, max_concurrent=max(64, 2 * config.clients))
    port = free_port()
    server = _server(app, port)
    serving = asyncio.ensure_future(server.serve())
    try:
        return await _soak(app, server, f"http://127.0.0.1:{port}", config, progress)
    finally:
        server.should_exit = True
        await serving


async def _soak(
    app: Any, server: uvicorn.Server, url: str, config: SoakConfig, progress: Progress
) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while not server.started:
        if time.monotonic() > deadline:
            raise SoakError("the server did not start within 600 s")
        await asyncio.sleep(0.1)
    watch = _Watch(app)
    windows = _Windows()
    started = time.monotonic()
    start = await _sample(watch, started, _Window())
    samples = [start]
    progress(
        f"serving {', '.join(config.models)}; {config.clients} clients for {config.minutes:g} min"
    )
    until = started + 60 * config.minutes
    work = _requests(config.models)
    clients = [
        asyncio.ensure_future(
            asyncio.to_thread(_client, url, work, until, config.seed + i, windows)
        )
        for i in range(config.clients)
    ]
    failures: list[str] = []
    while not all(c.done() for c in clients):
        await asyncio.wait(clients, timeout=config.sample_s)
        current = windows.take()
        failures += current.failures
        sample = await _sample(watch, started, current)
        samples.append(sample)
        progress(_line(sample))
    for client in clients:
        client.result()
    settled = await _settle(watch, start, started)
    progress(f"settled: {_line(settled)}")
    return _report(config, samples, settled, start, failures, time.monotonic() - started)


async def _settle(watch: _Watch, start: Sample, started: float) -> Sample:
    deadline = time.monotonic() + SETTLE_S
    while True:
        sample = await _sample(watch, started, _Window())
        clean = sample.kv_blocks == 0 and sample.in_flight == 0
        if (clean and sample.fds <= start.fds + FD_SLACK) or time.monotonic() > deadline:
            return sample
        await asyncio.sleep(0.2)


def _report(
    config: SoakConfig,
    samples: list[Sample],
    settled: Sample,
    start: Sample,
    failures: list[str],
    seconds: float,
) -> dict[str, Any]:
    """The report, in the one shape: a result row per sample, then the settled state; the
    checks as aims (each a count that must stay at or under its target)."""
    loaded = samples[1:] or samples
    rows = [{"phase": "load", **asdict(s)} for s in samples]
    rows.append(
        {
            "phase": "settled",
            **asdict(settled),
            "rss_growth_mb": round(settled.rss_mb - loaded[0].rss_mb, 1),
            "requests": sum(s.done for s in loaded),
            "failures": failures[:20],
        }
    )
    aims = [
        aim_entry("KV blocks held after the load", 0, settled.kv_blocks, compare="<="),
        aim_entry("requests in flight after the load", 0, settled.in_flight, compare="<="),
        aim_entry(
            "file descriptors over the start after the load",
            FD_SLACK,
            settled.fds - start.fds,
            compare="<=",
        ),
        aim_entry(
            "shared-memory files over the start after the load",
            0,
            settled.shm_files - start.shm_files,
            compare="<=",
        ),
        aim_entry("requests failed", 0, sum(s.failed for s in loaded), compare="<="),
    ]
    system = system_entry(
        "server",
        "create_app on uvicorn in this process, clients on threads of it",
        models=list(config.models),
    )
    return make_report(
        "soak",
        workload={**asdict(config), "settle_s": SETTLE_S},
        machine=machine_info(),
        systems=[system],
        results=rows,
        aims=aims,
        seconds=seconds,
    )


def _line(s: Sample) -> str:
    latency = "-" if s.p50_ms is None else f"{s.p50_ms:.0f}/{s.p99_ms:.0f} ms"
    return (
        f"t={s.t_s:7.1f} s  rss={s.rss_mb:8.1f} MB  fds={s.fds:4d}  kv={s.kv_blocks:4d}  "
        f"shm={s.shm_files:3d}  in-flight={s.in_flight:3d}  done={s.done:5d}  "
        f"failed={s.failed:3d}  short p50/p99={latency}"
    )


def format_report(report: dict[str, Any]) -> str:
    """The report as text: a line per sample, the settled state, the checks."""
    fields = set(Sample.__dataclass_fields__)
    rows = report["results"]
    lines = [_line(Sample(**{k: v for k, v in r.items() if k in fields})) for r in rows[:-1]]
    settled = rows[-1]
    lines.append(f"settled: {_line(Sample(**{k: v for k, v in settled.items() if k in fields}))}")
    lines.append(
        f"RSS growth under load: {settled['rss_growth_mb']} MB; {settled['requests']} requests"
    )
    for aim in report["aims"]:
        verdict = "ok " if aim["met"] else "FAILED"
        lines.append(f"  {verdict} {aim['name']}: {aim['measured']} (at most {aim['target']})")
    lines += [f"  failure: {f}" for f in settled["failures"]]
    return "\n".join(lines)


def run_soak_sync(config: SoakConfig, progress: Progress | None = None) -> dict[str, Any]:
    """``run_soak`` on a fresh event loop (uvloop when installed); progress on stderr.

    Raises:
        As ``run_soak``.
    """
    log: Progress = progress if progress is not None else ProgressLog()
    report: dict[str, Any] = run_async(run_soak, config, log)
    return report
