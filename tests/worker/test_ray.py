"""Launchers: workers that reach the pool over TCP, and workers as Ray actors on a local Ray.

The Ray tests need the optional extra (``pip install 'mstar-async[ray]'``) and skip without it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

from mstar_async.errors import MstarError, WorkerLost
from mstar_async.graph import ModelSource
from mstar_async.models import build_model
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.transport import CurveKeys, TransportError, generate_curve_keys
from mstar_async.worker.launchers import LocalLauncher, RayLauncher
from tests.worker.test_processes import assert_same, run_demo, wait_gone

pytestmark = pytest.mark.slow  # a Ray cluster per test

ONE_LOOP = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
INPUTS = {"text": "across hosts", "max_codes": 16, "steps": 2, "seed": 5}
CODEC_SPLIT = Placement(nodes={"codec": 1})
CPUS = 2  # one per rank: the cluster is full while the runtime is open


async def in_process() -> list[Any]:
    async with open_runtime(build_model("demo")) as runtime:
        return await run_demo(runtime, **INPUTS)


def parent_of(pid: int) -> tuple[int, str]:
    """The parent's pid and command name, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{ppid}/comm") as comm:
        return ppid, comm.read().strip()


def free_cpus(ray: Any) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def mstar_actors(ray: Any) -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("mstar-")
    ]


def mstar_groups(ray: Any) -> list[dict[str, Any]]:
    """The placement groups of mstar runtimes that Ray has not removed."""
    return [
        group
        for group in ray.util.placement_group_table().values()
        if group["name"].startswith("mstar-") and group["state"] != "REMOVED"
    ]


async def eventually(check: Callable[[], bool], seconds: float = 15.0) -> bool:
    """Whether ``check`` holds within ``seconds`` (Ray updates its state asynchronously)."""
    with anyio.move_on_after(seconds):
        while not check():  # noqa: ASYNC110  (Ray's state: nothing to wait on but time)
            await anyio.sleep(0.1)
    return check()


@ONE_LOOP
@pytest.mark.anyio
async def test_local_workers_reach_the_pool_over_tcp() -> None:
    expected = await in_process()
    launcher = LocalLauncher(endpoint_host="127.0.0.1")
    async with open_runtime(build_model("demo"), placement=CODEC_SPLIT, launcher=launcher) as rt:
        assert rt.pool is not None
        assert rt.pool.endpoint.startswith("tcp://127.0.0.1:")
        assert_same(await run_demo(rt, **INPUTS), expected)


@pytest.mark.anyio
async def test_a_launcher_needs_a_placement() -> None:
    with pytest.raises(ValueError, match="placement"):
        async with open_runtime(build_model("demo"), launcher=LocalLauncher()):
            pass


def test_without_ray_the_launcher_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an absent package looks like to import
    with pytest.raises(MstarError, match=r"pip install 'mstar-async\[ray\]'"):
        RayLauncher()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> CurveKeys:
    return generate_curve_keys(tmp_path_factory.mktemp("ray") / "keys")


@pytest.mark.anyio
@ONE_LOOP  # Ray's actors are what is under test, not the conductor's event loop
async def test_ray_actors_serve_the_same_answers_recover_and_end_with_the_runtime(
    local_ray: Any, keys: CurveKeys
) -> None:
    ray = local_ray
    expected = await in_process()
    # Ray is initialized here already: it joins that. The pool listens on this node's
    # address as Ray knows it, not loopback: CURVE keys, which the actors load by path.
    launcher = RayLauncher(curve_keys=keys)
    async with open_runtime(build_model("demo"), placement=CODEC_SPLIT, launcher=launcher) as rt:
        pool = rt.pool
        assert pool is not None
        assert pool.endpoint.startswith("tcp://")
        assert not pool.endpoint.startswith("tcp://0.0.0.0")
        pids = [pool.pid(0), pool.pid(1)]
        assert all(p is not None for p in pids)
        for pid in pids:
            assert pid is not None
            # A Ray worker process: started by the raylet, not by this process.
            assert parent_of(pid)[1] == "raylet"
        assert len(mstar_actors(ray)) == 2
        # One placement group for the pool, a bundle (one CPU) per rank.
        (group,) = mstar_groups(ray)
        assert group["strategy"] == "PACK"
        assert [b["CPU"] for b in group["bundles"].values()] == [1.0, 1.0]
        assert await eventually(lambda: free_cpus(ray) == 0)  # each rank holds a CPU of Ray's
        assert_same(await run_demo(rt, **INPUTS), expected)

        # An actor killed under the pool: Ray reports it dead, the pool starts a new one.
        victim = pids[1]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        with anyio.fail_after(60):
            while pool.pid(1) in (None, victim):  # noqa: ASYNC110  (another process's state)
                await anyio.sleep(0.05)
        assert pool.restarts(1) == 1
        pids.append(pool.pid(1))
        assert_same(await run_demo(rt, **INPUTS), expected)

    # Closing the runtime ends every actor and gives the cluster its CPUs back.
    assert wait_gone([p for p in pids if p is not None])
    assert await eventually(lambda: not mstar_actors(ray) and free_cpus(ray) == CPUS)
    assert mstar_groups(ray) == []
    assert mstar_actors(ray) == []
    assert free_cpus(ray) == CPUS
    assert ray.is_initialized()  # it was not the launcher's to shut down


@ONE_LOOP
@pytest.mark.anyio
async def test_a_rank_the_cluster_cannot_place_fails_to_start(
    local_ray: Any, keys: CurveKeys
) -> None:
    launcher = RayLauncher(
        resources_per_rank={0: {"no-such-accelerator": 1}}, start_timeout=2, curve_keys=keys
    )
    with pytest.raises(WorkerLost, match=r"did not reserve the ranks' resources.*no-such-acc"):
        async with open_runtime(build_model("demo"), placement=CODEC_SPLIT, launcher=launcher):
            pass
    assert await eventually(lambda: not mstar_actors(local_ray))


@ONE_LOOP
@pytest.mark.anyio
async def test_without_keys_the_pool_does_not_listen_on_the_nodes_address(local_ray: Any) -> None:
    # The test's cluster is on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); a node's LAN
    # address (TEST-NET-1 here, never dialed) is what a real cluster gives.
    launcher = RayLauncher(endpoint_host="192.0.2.1")
    with pytest.raises(TransportError, match="refusing to listen on tcp://.* without CURVE keys"):
        async with open_runtime(build_model("demo"), placement=CODEC_SPLIT, launcher=launcher):
            pass
    assert mstar_actors(local_ray) == []


@ONE_LOOP
@pytest.mark.anyio
async def test_a_placements_ray_launcher_reserves_its_resources_with_keys_made_for_the_run(
    local_ray: Any,
) -> None:
    ray = local_ray
    expected = await in_process()
    placement = Placement(
        nodes={"codec": 1}, strategy="SPREAD", resources={0: {"CPU": 1}, 1: {"CPU": 1}}
    )
    keys = CurveKeys.for_run()  # no folder: each actor gets its keys in its configuration
    launcher = RayLauncher.for_placement(placement, curve_keys=keys)
    async with open_runtime(build_model("demo"), placement=placement, launcher=launcher) as rt:
        (group,) = mstar_groups(ray)
        assert group["strategy"] == "SPREAD"
        assert len(group["bundles"]) == 2
        assert_same(await run_demo(rt, **INPUTS), expected)
    assert await eventually(lambda: not mstar_groups(ray) and free_cpus(ray) == CPUS)


@ONE_LOOP
@pytest.mark.anyio
async def test_a_rank_without_the_checkpoint_fails_its_start_naming_the_path_and_host(
    local_ray: Any, keys: CurveKeys
) -> None:
    model = build_model("demo")
    # What `--path` does to a model's source: every rank reads it at that path on its node.
    model.source = ModelSource(
        "mstar_async.models:build_model", {"name": "demo", "snac_path": "/no/such/codec"}
    )
    launcher = RayLauncher(curve_keys=keys, start_timeout=30)
    host = socket.gethostname()
    with pytest.raises(WorkerLost, match=rf"rank 0 on host {host}: no snac_path /no/such/codec"):
        async with open_runtime(model, placement=CODEC_SPLIT, launcher=launcher):
            pass
    assert await eventually(lambda: not mstar_actors(local_ray) and not mstar_groups(local_ray))
