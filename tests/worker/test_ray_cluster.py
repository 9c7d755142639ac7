"""``mstar serve --ray`` on a three-node Ray cluster on this machine: ranks pinned to nodes by
the placement's resources, served over HTTP, and a node lost mid-stream and replaced.

Every node is on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set in tests/conftest.py
and inherited by ``mstar serve``); each carries a custom resource (``node_a`` on the head,
``node_b``, ``node_c``; ``UNITS`` of it) that a placement's ``resources:`` asks for one of to
pin a rank to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mstar_async.placement import Placement
from tests.server.conftest import openai_client
from tests.server.live import http
from tests.server.process import alive, mstar_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"
MIB = 1024 * 1024
#: What each node of the test's cluster gets: little, as the machine has 2 cores.
NODE = {"num_cpus": 2, "object_store_memory": 80 * MIB, "include_dashboard": False}
#: Units of its custom resource a node has: a rank pinned to it asks for one.
UNITS = 4
LOOPBACK = {"node_ip_address": "127.0.0.1"}


def placement_file(tmp_path: Path, example: str, pins: dict[int, str]) -> str:
    """``example`` with each rank pinned to the node holding the custom resource ``pins[rank]``."""
    data = Placement.from_yaml(EXAMPLES / example).to_dict()
    data["resources"] = {rank: {"CPU": 1, node: 1} for rank, node in pins.items()}
    path = tmp_path / f"pinned-{example}"
    path.write_text(Placement.from_dict(data).to_yaml())
    return str(path)


def wait_until(check: Callable[[], bool], within: float, what: str) -> float:
    """Poll ``check`` until it holds; the seconds that took. Fails after ``within`` s."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within, f"{what} not within {within} s"
        time.sleep(0.1)
    return time.monotonic() - started


def ready(url: str) -> bool:
    try:
        return http("GET", f"{url}/health/ready", timeout=2).status == 200
    except OSError:
        return False


def leaked_segments(before: set[str]) -> set[str]:
    """Shared-memory segments made since ``before`` whose owner (``mstar-<pid>-...``) is gone:
    what nobody will unlink. Live processes' segments (other tests running here) do not count.
    """
    leaked = set()
    for entry in Path("/dev/shm").glob("mstar*"):
        owner = entry.name.split("-")[1] if entry.name.count("-") >= 2 else ""
        if entry.name not in before and not (owner.isdigit() and alive(int(owner))):
            leaked.add(entry.name)
    return leaked


def shm_segments() -> set[str]:
    return {entry.name for entry in Path("/dev/shm").glob("mstar*")}


def mstar_actor_pids(nodes: dict[str, Any]) -> list[int]:
    """Processes of this cluster's nodes (children of their raylets) that are Ray actors of an
    mstar runtime."""
    raylets = set()
    for node in nodes.values():
        for info in node.all_processes.get("raylet", []):
            raylets.add(info.process.pid)
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if b"MstarWorker" in command and parent in raylets and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def bundles_placed(ray: Any, nodes: dict[str, Any]) -> list[tuple[str, str]]:
    """For each rank's bundle of every mstar placement group: the node it asks for (its custom
    resource) and the node Ray put it on, sorted."""
    placed = []
    for group in mstar_groups(ray):
        for index, bundle in group["bundles"].items():
            asked = next(name for name in bundle if name.startswith("node_"))
            node_id = group["bundles_to_node_id"][index]
            on = next(name for name, node in nodes.items() if node.node_id == node_id)
            placed.append((asked, on))
    return sorted(placed)


def mstar_groups(ray: Any) -> list[dict[str, Any]]:
    return [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith("mstar-") and g["state"] != "REMOVED"
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """A three-node cluster and a driver connected to it (to look at placement groups)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    made = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "resources": {"node_a": UNITS}, **LOOPBACK},
    )
    try:
        nodes = {"node_a": made.head_node}
        for name in ("node_b", "node_c"):
            nodes[name] = made.add_node(**NODE, resources={name: UNITS}, **LOOPBACK)
        made.wait_for_nodes()
        ray.init(address=made.address, log_to_driver=False)
        print(f"cluster of 3 up in {time.monotonic() - started:.1f} s")
        yield ray, made, nodes
    finally:
        ray.shutdown()
        made.shutdown()


def test_orpheus_with_its_codec_on_another_node_speaks(
    cluster: tuple[Any, Any, dict[str, Any]], tmp_path: Path
) -> None:
    ray, made, nodes = cluster
    before = shm_segments()
    placement = placement_file(tmp_path, "orpheus_codec_split.yaml", {0: "node_a", 1: "node_b"})
    serve = ("orpheus", "--ray", made.address, "--placement", f"orpheus={placement}")
    started = time.monotonic()
    with mstar_serve(*serve, ready_within=150) as (url, process):
        print(f"orpheus served on the cluster in {time.monotonic() - started:.1f} s")
        assert bundles_placed(ray, nodes) == [("node_a", "node_a"), ("node_b", "node_b")]
        with openai_client(url) as client:
            speech = client.audio.speech.create(
                model="orpheus", input="Hello there.", voice="tara", extra_body={"max_tokens": 42}
            )
        assert speech.content[:4] == b"RIFF" and len(speech.content) > 44
        assert len(mstar_actor_pids(nodes)) == 2
    assert process.returncode == 0
    wait_until(lambda: not mstar_groups(ray), 20, "the placement group removed")
    wait_until(lambda: not mstar_actor_pids(nodes), 20, "the actors ended")
    assert not leaked_segments(before)


def test_a_lost_decode_node_fails_its_stream_and_its_replacement_serves(
    cluster: tuple[Any, Any, dict[str, Any]], tmp_path: Path
) -> None:
    ray, made, nodes = cluster
    before = shm_segments()
    placement = placement_file(tmp_path, "prefill_decode.yaml", {0: "node_a", 1: "node_c"})
    speaker = placement_file(tmp_path, "orpheus_codec_split.yaml", {0: "node_a", 1: "node_b"})
    serve = ("causal-lm", "orpheus", "--ray", made.address)
    serve += ("--placement", f"causal-lm={placement}", "--placement", f"orpheus={speaker}")
    chat: dict[str, Any] = {
        "model": "causal-lm",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 600,
        "extra_body": {"ignore_eos": True},
    }
    with mstar_serve(*serve, ready_within=150) as (url, process), openai_client(url) as client:
        pairs = [("node_a", "node_a")] * 2 + [("node_b", "node_b"), ("node_c", "node_c")]
        assert bundles_placed(ray, nodes) == pairs
        stream = client.chat.completions.create(stream=True, **chat)
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        next(chunks)  # decoding on node_c now
        assert len(mstar_actor_pids(nodes)) == 4
        (on_c,) = mstar_actor_pids({"node_c": nodes["node_c"]})
        remover = threading.Thread(target=made.remove_node, args=(nodes.pop("node_c"),))
        lost_at = time.monotonic()
        remover.start()
        failed_after, read = _read_until_it_fails(chunks)
        remover.join(30)
        print(f"the lost node's stream failed {failed_after - lost_at:.3f} s after the removal")
        assert failed_after - lost_at < 10, f"read {read} chunks after the node went"
        assert not ready(url)  # rank 1 is restarting: no node has node_c
        wait_until(lambda: not alive(on_c), 10, "the lost node's actor ended")
        assert len(mstar_actor_pids(nodes)) == 3  # the survivors' actors, untouched
        body = http("GET", f"{url}/health/ready").json()
        assert "worker rank 1 is restarting" in str(body), body
        # The other model, on node_a and node_b, is served all along.
        speech = client.audio.speech.create(
            model="orpheus", input="Still here.", voice="tara", extra_body={"max_tokens": 28}
        )
        assert speech.content[:4] == b"RIFF" and len(speech.content) > 44

        added_at = time.monotonic()
        nodes["node_c"] = made.add_node(**NODE, resources={"node_c": UNITS}, **LOOPBACK)
        back = wait_until(lambda: ready(url), 90, "rank 1 back on the new node_c")
        print(f"rank 1 ready on the new node {back:.1f} s after the node was added")
        assert bundles_placed(ray, nodes) == pairs  # rank 1 on the new node_c
        reply = client.chat.completions.create(**{**chat, "max_tokens": 8})
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        print(f"served again {time.monotonic() - added_at:.1f} s after the node was added")
    assert process.returncode == 0
    wait_until(lambda: not mstar_groups(ray), 20, "the placement group removed")
    wait_until(lambda: not mstar_actor_pids(nodes), 20, "the actors ended")
    assert not leaked_segments(before)


def _read_until_it_fails(chunks: Iterator[Any]) -> tuple[float, int]:
    """Read the stream until it raises (an error event, a broken connection); when that was,
    and how many chunks came first. A stream that ends without an error fails the test."""
    import openai

    read = 0
    try:
        for _ in chunks:
            read += 1
    except (openai.APIError, OSError) as exc:
        assert "rank 1" in str(exc) or not isinstance(exc, openai.APIError), exc
        return time.monotonic(), read
    raise AssertionError(f"the stream ended without an error after {read} more chunks")
