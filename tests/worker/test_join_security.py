"""Whom a worker that joins over TCP trusts, and with what: it builds only the model sources its
own command line allows, whatever a runtime names; with CURVE keys it talks only to the runtime
holding the runtime key, a runtime admits only workers holding the worker key, and nothing on
the wire is in the clear. Every worker here is a separate ``mstar worker`` process."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq

from mstar_async.errors import MstarError
from mstar_async.models import build_model
from mstar_async.runtime import open_runtime
from mstar_async.transport import CurveKeys, TransportError, generate_curve_keys
from mstar_async.worker.control import Bye, Welcome, decode_control, encode_control
from mstar_async.worker.join import JOIN_FAILED, run_remote_worker
from mstar_async.worker.main import WorkerConfig
from mstar_async.worker.remote import RemoteLauncher
from mstar_async.worker.sources import ZOO_BUILDER
from tests.server.process import free_port
from tests.transport.support import tapped
from tests.worker.joining import (
    CODEC_SPLIT,
    INPUTS,
    ONE_LOOP,
    Workers,
    in_process,
    launcher,
)
from tests.worker.test_processes import assert_same, run_demo


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return generate_curve_keys(tmp_path / "keys")


@pytest.fixture
def impostor(keys: CurveKeys, tmp_path: Path) -> Path:
    """A key folder with the runtime's public key and another worker keypair."""
    other = generate_curve_keys(tmp_path / "other-keys").folder
    (other / "runtime.key_secret").unlink()
    shutil.copy2(keys.folder / "runtime.key", other / "runtime.key")
    return other


def goodbye(conductor: zmq.Socket[bytes], seconds: float) -> Bye:
    """The first ``Bye`` a worker sends the fake runtime (resent joins skipped)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if conductor.poll(int(left * 1000)):
            message = decode_control(conductor.recv_multipart()[1])
            if isinstance(message, Bye):
                return message
    raise AssertionError(f"no goodbye within {seconds} s")


# ---- what a joining worker builds -------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "options"),
    [
        ("subprocess:getoutput", {"cmd": "touch {mark}"}),
        ("tests.worker.import_canary:build", {}),
        (ZOO_BUILDER, {"name": "causal-lm"}),  # a zoo model, but not the one it serves
    ],
    ids=["subprocess", "import", "zoo-model"],
)
@pytest.mark.timeout(90)
def test_a_worker_refuses_a_source_it_was_not_started_to_build_and_imports_nothing(
    workers: Workers, tmp_path: Path, target: str, options: dict[str, Any]
) -> None:
    mark = tmp_path / "imported"
    options = {k: v.format(mark=mark) if isinstance(v, str) else v for k, v in options.items()}
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    conductor = ctx.socket(zmq.ROUTER)
    conductor.setsockopt(zmq.LINGER, 0)
    conductor.bind(f"tcp://127.0.0.1:{port}")
    try:
        env = {"MSTAR_TEST_CANARY": str(mark)}
        proc = workers.start(port, 1, env=env, args=["--model", "demo"])
        assert conductor.poll(60_000), workers.stderr(1)
        identity, _ = conductor.recv_multipart()
        source = {"target": target, "options": options}
        config = WorkerConfig(1, 1, "", source, ["codec"], 0)
        welcome = Welcome(config.__dict__, data_port=free_port(), heartbeat=0.1, timeout=5.0)
        conductor.send_multipart([identity, encode_control(welcome)])
        bye = goodbye(conductor, 30)
        assert proc.wait(timeout=30) == JOIN_FAILED
    finally:
        conductor.close()
        ctx.term()
    asked = repr(options["name"]) if target == ZOO_BUILDER else repr(target)
    assert bye.code == JOIN_FAILED and bye.error.startswith("SourceRefused: ")
    assert asked in bye.error and "it builds the zoo models ['demo']" in bye.error
    stderr = workers.stderr(1)
    assert "refusing what the runtime at tcp://127.0.0.1:" in stderr and asked in stderr
    assert "building engines" not in stderr
    assert not mark.exists()  # nothing was run, nothing named was imported


# ---- CURVE ------------------------------------------------------------------------------


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_worker_with_the_keys_joins_serves_and_sends_nothing_in_the_clear(
    workers: Workers, keys: CurveKeys
) -> None:
    expected = await in_process()
    port = free_port()
    # The worker reaches the control socket through a relay that keeps every byte.
    async with tapped(port) as (relay_port, seen):
        proc = workers.start(relay_port, 1, args=["--curve-keys", str(keys.folder)])
        # Rank 0 is a local child: it dials the pool over TCP too, with the same keys.
        remote = launcher(port, ranks=[1], curve_keys=keys)
        assert f"--rank 1 --curve-keys {keys.folder}" in remote.command(1)
        async with open_runtime(
            build_model("demo"), placement=CODEC_SPLIT, launcher=remote
        ) as runtime:
            assert_same(await run_demo(runtime, **INPUTS), expected)
        assert await anyio.to_thread.run_sync(proc.wait, 30) == 0, workers.stderr(1)
    assert len(seen) > 500  # the handshake, the join, the welcome, heartbeats, the goodbye
    for plain in (b"join", b"welcome", b"beat", ZOO_BUILDER.encode(), b"codec"):
        assert plain not in seen
    for key in (keys.runtime_secret, keys.worker_secret, keys.runtime_public, keys.worker_public):
        assert key is not None and key not in seen
        assert zmq.utils.z85.decode(key) not in seen


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_worker_without_the_keys_gets_no_join_through_and_says_so(
    workers: Workers, keys: CurveKeys, impostor: Path
) -> None:
    remote = RemoteLauncher("tcp://127.0.0.1:0", ranks=[1], curve_keys=keys)
    await remote.open()
    try:
        source = build_model("demo").source
        assert source is not None
        config = WorkerConfig(1, 1, "tcp://127.0.0.1:1", source.to_dict(), ["codec"], 0)
        rank = await remote.start(config)  # rank 1 waits: a join that got through is welcomed
        port = int(remote.address.rsplit(":", 1)[1])
        wait = ["--join-timeout", "3"]
        procs = {
            "none": workers.start(port, 1, args=wait, name="none"),
            "impostor": workers.start(
                port, 1, args=[*wait, "--curve-keys", str(impostor)], name="impostor"
            ),
        }
        for proc in procs.values():
            assert await anyio.to_thread.run_sync(proc.wait, 60) == JOIN_FAILED
        assert not rank.joined and rank.returncode is None  # not one join was delivered
    finally:
        await remote.aclose()
    said = f"rank 1: no runtime answered at {remote.address} within 3 s"
    assert f"{said} (this worker has no CURVE keys: a runtime that uses them never answers" in (
        workers.stderr("none")
    )
    assert f"{said} (this worker uses the CURVE keys in {impostor}" in workers.stderr("impostor")


# ---- without keys -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_without_keys_nothing_listens_or_joins_beyond_loopback(keys: CurveKeys) -> None:
    with pytest.raises(TransportError, match=r"refusing to listen on tcp://0\.0\.0\.0:0"):
        await RemoteLauncher("tcp://0.0.0.0:0").open()
    with pytest.raises(MstarError, match=r"refusing to join tcp://10\.255\.0\.7:5555 without"):
        run_remote_worker("tcp://10.255.0.7:5555", 1)
    everywhere = RemoteLauncher("tcp://0.0.0.0:0", curve_keys=keys)
    await everywhere.open()
    await everywhere.aclose()


@pytest.mark.timeout(30)
def test_a_runtime_needs_its_own_secret_key(keys: CurveKeys, tmp_path: Path) -> None:
    (keys.folder / "runtime.key_secret").unlink()  # a worker host's folder
    with pytest.raises(TransportError, match=r"no runtime\.key_secret"):
        RemoteLauncher("tcp://0.0.0.0:0", curve_keys=CurveKeys.load(keys.folder))
