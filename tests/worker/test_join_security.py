"""Whom a worker that joins over TCP trusts: it builds only the model sources its own command
line allows, whatever a runtime names. Every worker here is a separate ``mstar worker``
process."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from mstar_async.transport import CurveKeys, generate_curve_keys
from mstar_async.worker.control import Bye, Welcome, decode_control, encode_control
from mstar_async.worker.join import JOIN_FAILED
from mstar_async.worker.main import WorkerConfig
from mstar_async.worker.sources import ZOO_BUILDER
from tests.worker.joining import (
    Workers,
    free_port,
)


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
