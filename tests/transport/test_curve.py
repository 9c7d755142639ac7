"""CURVE on TCP links: keys made and loaded, only known clients get a message through, nothing
secret (nor the messages themselves) on the wire, and no TCP listening beyond loopback without
keys."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
from zmq.auth.thread import AuthenticationThread
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from mstar_async.transport import (
    CurveClient,
    CurveKeys,
    Hello,
    TransportError,
    ZmqHub,
    generate_curve_keys,
)
from mstar_async.transport.secure import is_loopback

from .support import tapped

pytestmark = pytest.mark.anyio

MARKER = "plaintext-marker-7f3a"
HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
}


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return generate_curve_keys(tmp_path / "keys")


@pytest.fixture
def strangers(tmp_path: Path) -> CurveKeys:
    return generate_curve_keys(tmp_path / "other-keys")


@pytest.fixture
def hub() -> Iterator[ZmqHub]:
    with ZmqHub() as opened:
        yield opened
    assert opened.open_sockets == 0
    assert not [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]


def hello(endpoint: str = MARKER) -> Hello:
    return Hello(1, 2, endpoint, ["codec"], "")


# ---- keys -----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_generated_keys_are_private_and_never_overwritten(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "keys"
    keys = generate_curve_keys(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes == {
        "runtime.key": 0o644,
        "runtime.key_secret": 0o600,
        "worker.key": 0o644,
        "worker.key_secret": 0o600,
    }
    assert CurveKeys.load(folder) == keys
    assert keys.runtime_public != keys.worker_public
    assert keys.runtime_secret is not None and keys.runtime_secret.decode() not in repr(keys)
    with pytest.raises(TransportError, match="not overwriting"):
        generate_curve_keys(folder)
    assert CurveKeys.load(folder) == keys


@pytest.mark.timeout(30)
def test_a_worker_host_holds_only_its_secret(keys: CurveKeys, tmp_path: Path) -> None:
    worker_host = tmp_path / "worker-host"
    worker_host.mkdir(mode=0o700)
    for name in ("runtime.key", "worker.key_secret"):
        shutil.copy2(keys.folder / name, worker_host / name)
    there = CurveKeys.load(worker_host)
    assert there.runtime_secret is None
    assert there.runtime_client() == keys.runtime_client()
    assert there.peer_server() == keys.peer_server()
    with pytest.raises(TransportError, match=r"no runtime\.key_secret"):
        there.runtime_server()


@pytest.mark.timeout(30)
def test_unusable_key_folders_are_refused_saying_why(keys: CurveKeys, tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="mstar keys generate"):
        CurveKeys.load(tmp_path / "nowhere")
    secret = keys.folder / "worker.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(TransportError, match=r"open to other users \(mode 644\)"):
        CurveKeys.load(keys.folder)
    os.chmod(secret, 0o600)
    (keys.folder / "runtime.key").unlink()
    (keys.folder / "runtime.key_secret").unlink()
    with pytest.raises(TransportError, match=r"neither runtime\.key nor runtime\.key_secret"):
        CurveKeys.load(keys.folder)


# ---- links ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_a_worker_key_gets_through_on_every_interface(hub: ZmqHub, keys: CurveKeys) -> None:
    with anyio.fail_after(20):
        server = hub.bind("tcp://0.0.0.0:0", curve=keys.runtime_server())
        port = server.endpoint.rsplit(":", 1)[1]
        link = hub.connect(f"tcp://127.0.0.1:{port}", identity=b"w", curve=keys.runtime_client())
        await link.send(hello())
        assert await server.recv() == (b"w", hello())
        await server.send(b"w", hello("back"))
        assert await link.recv() == hello("back")
        peers = hub.bind("tcp://127.0.0.1:0", curve=keys.peer_server())
        peer = hub.connect(peers.endpoint, identity=b"p", curve=keys.peer_client())
        await peer.send(hello())
        assert await peers.recv() == (b"p", hello())


async def failed_handshake(
    ctx: zmq.asyncio.Context, endpoint: str, client: CurveClient | None
) -> None:
    """Dial ``endpoint`` as ``client`` (no keys: None), send one message, and return once the
    handshake has failed."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if client is not None:
        sock.curve_secretkey = client.secret
        sock.curve_publickey = client.public
        sock.curve_serverkey = client.server
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        await sock.send(b"from a stranger")
        while (await recv_monitor_message(monitor))["event"] not in HANDSHAKE_FAILED:
            pass
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


@pytest.mark.timeout(60)
async def test_a_client_without_the_right_keys_gets_no_message_through(
    hub: ZmqHub, keys: CurveKeys, strangers: CurveKeys
) -> None:
    server = hub.bind("tcp://127.0.0.1:0", curve=keys.runtime_server())
    wrong_client = CurveClient(
        strangers.worker_public, strangers.worker_secret, keys.runtime_public
    )
    # Holds the worker key but dials a server it does not trust (a runtime with other keys).
    wrong_server = CurveClient(keys.worker_public, keys.worker_secret, strangers.runtime_public)
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(30):
            for client in (None, wrong_client, wrong_server):
                await failed_handshake(ctx, server.endpoint, client)
            # Every stranger's handshake failed; the first message the server ever delivers is
            # the one from the worker key.
            link = hub.connect(server.endpoint, identity=b"w", curve=keys.runtime_client())
            await link.send(hello())
            assert await server.recv() == (b"w", hello())
    finally:
        ctx.term()


@pytest.mark.parametrize("secured", [True, False], ids=["curve", "plain"])
@pytest.mark.timeout(30)
async def test_neither_keys_nor_messages_cross_the_wire_in_the_clear(
    hub: ZmqHub, keys: CurveKeys, secured: bool
) -> None:
    with anyio.fail_after(20):
        server = hub.bind("tcp://127.0.0.1:0", curve=keys.runtime_server() if secured else None)
        async with tapped(int(server.endpoint.rsplit(":", 1)[1])) as (port, seen):
            link = hub.connect(
                f"tcp://127.0.0.1:{port}",
                identity=b"w",
                curve=keys.runtime_client() if secured else None,
            )
            await link.send(hello())
            assert await server.recv() == (b"w", hello())
            await server.send(b"w", hello("back"))
            assert await link.recv() == hello("back")
            link.close()
    if not secured:  # the relay does see what travels in the clear
        assert MARKER.encode() in seen
        return
    assert len(seen) > 300  # the handshake and both messages went through the relay
    assert MARKER.encode() not in seen and b"back" not in seen
    for key in (keys.runtime_secret, keys.worker_secret, keys.runtime_public, keys.worker_public):
        assert key is not None
        assert key not in seen and z85.decode(key) not in seen


# ---- without keys ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_without_keys_tcp_listens_on_loopback_only(hub: ZmqHub, keys: CurveKeys) -> None:
    for endpoint in ("tcp://0.0.0.0:0", "tcp://*:0"):
        with pytest.raises(TransportError, match="refusing to listen .* without CURVE keys"):
            hub.bind(endpoint)
    assert hub.bind("tcp://127.0.0.1:0").endpoint.startswith("tcp://127.0.0.1:")
    assert hub.bind("tcp://localhost:0").endpoint.startswith("tcp://127.0.0.1:")
    assert hub.bind("tcp://0.0.0.0:0", curve=keys.runtime_server()).endpoint
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.0.1", "[::1]", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "*", "10.1.2.3", "no-such-host.invalid")] == [
        False
    ] * 4


@pytest.mark.timeout(30)
def test_ipc_sockets_live_in_a_folder_only_this_user_enters(hub: ZmqHub, keys: CurveKeys) -> None:
    server = hub.bind(curve=keys.runtime_server())  # keys are no business of IPC
    folder = Path(server.endpoint.removeprefix("ipc://")).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert folder.stat().st_uid == os.getuid()


def test_keys_made_for_a_run_hand_a_worker_its_keys_and_never_the_runtime_secret() -> None:
    keys = CurveKeys.for_run()
    assert keys.folder is None
    assert keys.runtime_public != CurveKeys.for_run().runtime_public  # fresh every run
    material = keys.worker_material()
    assert set(material) == {"runtime_public", "worker_public", "worker_secret"}
    assert keys.runtime_secret is not None
    assert keys.runtime_secret.decode() not in material.values()
    worker = CurveKeys.from_material(material)
    assert worker.runtime_client() == keys.runtime_client()
    assert worker.peer_server() == keys.peer_server()
    with pytest.raises(TransportError, match="made for one run, hold no runtime secret key"):
        worker.runtime_server()
    with pytest.raises(TransportError, match="lacks a valid worker_secret"):
        CurveKeys.from_material({**material, "worker_secret": "short"})
