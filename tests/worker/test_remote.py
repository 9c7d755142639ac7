"""Workers that join over plain TCP (``mstar worker``) as a user would start them on other hosts.

Every worker here is a separate ``python -m mstar_async.cli worker`` process on 127.0.0.1, not a
child the runtime started.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from mstar_async.errors import MstarError, RequestError, WorkerLost
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
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
from mstar_async.worker.join import CONDUCTOR_LOST, JOIN_FAILED, run_remote_worker
from mstar_async.worker.main import WorkerConfig
from mstar_async.worker.remote import RemoteLauncher
from tests.server.process import free_port
from tests.worker.joining import (
    CODEC_SPLIT,
    INPUTS,
    ONE_LOOP,
    Workers,
    in_process,
    launcher,
)
from tests.worker.models import build_demo_needing_a_checkpoint
from tests.worker.test_processes import assert_same, run_demo


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_joined_workers_give_in_process_answers_and_exit_on_close(
    workers: Workers,
) -> None:
    expected = await in_process()
    port = free_port()
    # Started before the runtime listens: they keep asking until it answers.
    procs = [workers.start(port, rank) for rank in (0, 1)]
    async with open_runtime(
        build_model("demo"), placement=CODEC_SPLIT, launcher=launcher(port)
    ) as runtime:
        pool = runtime.pool
        assert pool is not None
        assert pool.endpoint.startswith("tcp://127.0.0.1:")
        assert [pool.pid(0), pool.pid(1)] == [p.pid for p in procs]
        assert_same(await run_demo(runtime, **INPUTS), expected)
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=10) == 0, workers.stderr(rank)
        assert "exiting with status 0" in workers.stderr(rank)


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_a_killed_worker_is_worker_lost_naming_its_rank(workers: Workers) -> None:
    port = free_port()
    procs = [workers.start(port, rank) for rank in (0, 1)]
    async with open_runtime(
        build_model("demo"), placement=CODEC_SPLIT, launcher=launcher(port)
    ) as runtime:
        pool = runtime.pool
        assert pool is not None
        with pytest.raises(RequestError) as failed, anyio.fail_after(60):
            async with runtime.generate(text="long", max_codes=4000, steps=2) as outputs:
                async for item in outputs:
                    # The codec (rank 1) has served this request: now its worker dies.
                    if isinstance(item, AudioChunk) and procs[1].poll() is None:
                        os.kill(procs[1].pid, signal.SIGKILL)
        lost = failed.value.__cause__
        assert isinstance(lost, WorkerLost) and "worker rank 1" in str(lost)
        # Its heartbeats stop: the rank is down and nothing restarts it, which it says.
        with anyio.fail_after(30):
            while not pool.ranks[1].down:  # noqa: ASYNC110  (the launcher's thread decides)
                await anyio.sleep(0.05)
        assert pool.restarts(1) == 1
        with pytest.raises(RequestError) as later:
            await run_demo(runtime, **INPUTS)
        assert isinstance(later.value.__cause__, WorkerLost)
        message = str(later.value.__cause__)
        assert "rank 1 is down" in message and "not restarted" in message
    assert procs[0].wait(timeout=10) == 0, workers.stderr(0)


@pytest.mark.timeout(60)
def test_a_worker_whose_conductor_goes_silent_exits(workers: Workers) -> None:
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    conductor = ctx.socket(zmq.ROUTER)
    conductor.setsockopt(zmq.LINGER, 0)
    conductor.bind(f"tcp://127.0.0.1:{port}")
    try:
        proc = workers.start(port, 1)
        assert conductor.poll(30_000), workers.stderr(1)
        identity, frame = conductor.recv_multipart()
        join = decode_control(frame)
        assert isinstance(join, Join) and join.rank == 1 and join.pid == proc.pid
        config = WorkerConfig(1, 1, "", build_model("demo").source.to_dict(), ["codec"], 0)  # type: ignore[union-attr]
        welcome = Welcome(config.__dict__, data_port=free_port(), heartbeat=0.1, timeout=1.0)
        conductor.send_multipart([identity, encode_control(welcome)])
        # ... and then never answers a heartbeat, as a conductor whose host died.
        assert proc.wait(timeout=30) == CONDUCTOR_LOST
        assert "no answer from the runtime" in workers.stderr(1)
    finally:
        conductor.close()
        ctx.term()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_worker_for_a_rank_that_is_not_remote_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    remote = RemoteLauncher("tcp://127.0.0.1:0", ranks=[1])
    await remote.open()
    try:
        code = await anyio.to_thread.run_sync(
            lambda: run_remote_worker(remote.address, 0, join_timeout=10)
        )
    finally:
        await remote.aclose()
    assert code == JOIN_FAILED
    assert "rank 0 is not a remote rank of this runtime (remote ranks: [1])" in (
        capsys.readouterr().err
    )


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_rank_nobody_joins_fails_the_start_naming_it_and_the_command() -> None:
    port = free_port()
    with pytest.raises(WorkerLost) as failed:
        async with open_runtime(
            build_model("demo"),
            placement=CODEC_SPLIT,
            launcher=launcher(port, ranks=[1], join_timeout=1.0),
        ):
            pass
    message = str(failed.value)
    assert "worker rank 1" in message
    assert f"--conductor tcp://127.0.0.1:{port} --rank 1" in message


@ONE_LOOP
@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_worker_that_cannot_build_its_model_fails_the_start_with_its_error(
    workers: Workers,
) -> None:
    port = free_port()
    builder = "tests.worker.models:build_demo_needing_a_checkpoint"
    proc = workers.start(port, 1, env={"MSTAR_TEST_NO_CHECKPOINT": "1"}, args=["--source", builder])
    with pytest.raises(WorkerLost) as failed:
        async with open_runtime(
            build_demo_needing_a_checkpoint(),
            placement=CODEC_SPLIT,
            launcher=launcher(port, ranks=[1]),
        ):
            pass
    message = str(failed.value)
    assert "worker rank 1 exited before it was ready" in message
    assert "FileNotFoundError: no checkpoint folder /models/demo on this host" in message
    assert proc.wait(timeout=10) == 1


def test_placement_hosts_pick_the_remote_ranks() -> None:
    placement = Placement(
        nodes={"codec": [1, 2]}, hosts={0: "127.0.0.1", 1: "localhost", 2: "10.255.0.7"}
    )
    remote = RemoteLauncher.for_placement(placement, "tcp://0.0.0.0:0")
    assert [remote.is_remote(rank) for rank in range(3)] == [False, False, True]
    assert remote.hosts == {2: "10.255.0.7"}
    assert RemoteLauncher().is_remote(7)  # without ranks: every rank joins


def test_bad_addresses_and_timings_are_refused() -> None:
    with pytest.raises(MstarError, match="tcp://HOST:PORT"):
        RemoteLauncher("10.0.0.1")
    with pytest.raises(ValueError, match="longer than heartbeat"):
        RemoteLauncher(heartbeat=2.0, timeout=1.0)
    with pytest.raises(ValueError, match="names no host"):
        run_remote_worker("tcp://:5555", 0)


texts = st.text(max_size=40)


@given(
    st.one_of(
        st.builds(Join, st.integers(0, 1 << 20), texts, st.integers(1, 1 << 22), texts),
        st.builds(Beat, texts),
        st.builds(Bye, texts, st.integers(-255, 255)),
        st.builds(Refuse, texts),
        st.builds(Stop, texts),
    )
)
def test_control_messages_round_trip(message: Any) -> None:
    assert decode_control(encode_control(message)) == message


@pytest.mark.parametrize("frame", [b"", b"not json", b'{"type": "nope"}', b"[1, 2]"])
def test_a_stray_frame_on_the_control_port_is_ignored(frame: bytes) -> None:
    assert decode_control(frame) is None


def test_tcp_addresses() -> None:
    assert split_tcp("tcp://10.0.0.1:5555") == ("10.0.0.1", 5555)
    assert split_tcp("node-3:7000") == ("node-3", 7000)
    assert split_tcp(":0") == ("0.0.0.0", 0)
    assert split_tcp("tcp://[fd00::2]:5555") == ("[fd00::2]", 5555)
    for bad in ("10.0.0.1", "tcp://host:", "host:99999", "host:port"):
        with pytest.raises(MstarError, match="not a TCP address"):
            split_tcp(bad)
