"""The transport benchmark, run once in quick mode.

No speed is asserted (the machine may be busy): only that the result has every transport,
tensor size, placement and aim, that the timings are ordered as they must be (first audio, then
the end of the speech, then the end of the request), that it is JSON-ready, and that the text
report shows them all.
"""

from __future__ import annotations

from typing import Any

import pytest

from mstar_async.bench.common import quiet
from mstar_async.bench.report import check_report
from mstar_async.bench.split_decode import SPLITS
from mstar_async.bench.transport import (
    PLACEMENTS,
    TRANSPORTS,
    format_transport,
    rows,
    run_transport,
)
from mstar_async.transport.shm import SHM_TENSOR_BYTES
from tests.benchmarks.runs import BenchRun

MESSAGES = ("ping", "step")
KINDS = ("header", "latency", "throughput", "placement", "split")
SYSTEM_ROWS = (
    "copy_ (baseline)",
    "torch.clone",
    f"ipc (shm >= {SHM_TENSOR_BYTES >> 20} MiB)",
    "ipc, frames only",
    "tcp",
    "in-process hand-over",
)
# The first test runs the whole quick benchmark (five runtimes, eight worker processes):
# about 30 s on two idle cores, several times that on a loaded machine.
pytestmark = pytest.mark.timeout(420)


# The benchmark runs once for every test here (``transport_run``, ``mstar bench transport
# --quick --json``); it makes its own event loop, so nothing here is parametrised over the
# conftest's event loops.
@pytest.fixture(scope="module")
def result(transport_run: BenchRun) -> dict[str, Any]:
    return transport_run.report


def test_shape_and_workload(result: dict[str, Any]) -> None:
    assert result["benchmark"] == "transport"
    assert result["workload"]["mode"] == "quick"
    assert result["workload"]["tensor_sizes"] == [1 << 20, 8 << 20]
    assert result["workload"]["large_tensor_bytes"] == 8 << 20
    assert any("8 MB" in note for note in result["workload"]["notes"])
    assert result["machine"]["cpu_count"] >= 1
    assert result["seconds"] > 0
    names = {entry["name"] for entry in result["systems"]}
    assert names == {"copy", "clone", "ipc", "ipc-frames", "tcp", "inproc", "ours", "raw"} | set(
        PLACEMENTS
    ) | set(SPLITS)
    measurements = [row["measurement"] for row in result["results"]]
    assert measurements == sorted(measurements, key=KINDS.index)  # grouped, in this order
    assert measurements.count("header") == 1


def test_latency_has_ours_and_raw_for_every_transport(result: dict[str, Any]) -> None:
    found = {(e["transport"], e["message"]): e for e in rows(result, "latency")}
    assert set(found) == {(t, m) for t in TRANSPORTS for m in MESSAGES}
    for entry in found.values():
        assert entry["ours_p50_us"]["median"] > 0
        assert entry["ours_p90_us"]["median"] >= entry["ours_p50_us"]["median"] > 0
        assert entry["raw_p50_us"]["median"] > 0
        assert entry["ratio_ours_raw"]["median"] > 0
        assert entry["ratio_ours_raw"]["n"] == 1


def test_throughput_has_every_size_and_system(result: dict[str, Any]) -> None:
    throughput = rows(result, "throughput")
    assert [e["size_bytes"] for e in throughput] == [1 << 20, 8 << 20]
    for entry in throughput:
        systems = entry["systems"]
        assert set(systems) == {"copy", "clone", "ipc", "ipc-frames", "tcp", "inproc"}
        for system in systems.values():
            assert system["gb_per_s"]["median"] > 0
            assert system["ms"]["median"] > 0
        for link in ("ipc", "ipc-frames", "tcp"):
            assert systems[link]["zero_copy_recv"] is True
        # Over IPC, tensors of SHM_TENSOR_BYTES or more come through shared memory.
        assert systems["ipc"]["shared_memory"] is (entry["size_bytes"] >= SHM_TENSOR_BYTES)
        assert systems["inproc"]["copies"] == 0
        assert set(entry["ratios"]) == {"ipc/copy", "ipc/clone", "ipc-frames/copy", "tcp/copy"}


def test_every_placement_streams_audio_before_it_ends(result: dict[str, Any]) -> None:
    placements = {e["placement"]: e for e in rows(result, "placement")}
    assert list(placements) == list(PLACEMENTS)
    assert [placements[p]["processes"] for p in PLACEMENTS] == [0, 1, 2, 3, 2]
    assert [placements[p]["transport"] for p in PLACEMENTS] == ["inproc", *["ipc"] * 3, "tcp"]
    assert placements["codec-split-tcp"]["launcher"] == "remote"
    assert placements["replicas"]["spec"]["nodes"] == {"codec": [1, 2]}
    for entry in placements.values():
        assert entry["requests"] == 2
        samples = [entry[f"{key}_ms_samples"] for key in ("ttfa", "last_audio", "total")]
        assert [len(s) for s in samples] == [2, 2, 2]
        for ttfa, last, total in zip(*samples, strict=True):
            # First audio comes before the speech ends, which comes before the image.
            assert 0 < ttfa <= last < total < 60_000
        medians = [entry[f"{key}_ms"]["median"] for key in ("ttfa", "last_audio", "total")]
        assert 0 < medians[0] <= medians[1] < medians[2]
        assert entry["startup_s"] > 0
        assert entry["audio_chunks"] > 0 and entry["audio_seconds"] > 0
        assert entry["torch_threads"] >= 1


def test_the_split_decodes_after_a_kv_move_that_never_crosses_the_conductor(
    result: dict[str, Any],
) -> None:
    split = {e["layout"]: e for e in rows(result, "split")}
    assert list(split) == ["co-located", "split-ipc"]  # quick mode: no TCP
    for entry in split.values():
        assert entry["requests"] == 2 and len(entry["itl_ms_samples"]) == 2
        assert 0 < entry["itl_ms"]["median"] < entry["ttft_ms"]["median"] + 1_000
        assert entry["conductor"]["step_messages"] == 0
        assert entry["conductor"]["state_bytes"] == 0
    assert "move" not in split["co-located"] and "itl_ratio" not in split["co-located"]
    move = split["split-ipc"]["move"]
    # Every request's KV moved (the prompt's tokens, 23 KB a token on SmolLM2-135M), and far
    # fewer bytes than that reached the conductor.
    assert move["mb"]["median"] > 1.0 and move["mb_per_s"]["median"] > 0
    crossed = split["split-ipc"]["conductor"]["bytes_received_per_request"]["median"]
    assert crossed < move["mb"]["median"] * 1e6 / 10
    assert split["split-ipc"]["itl_ratio"]["n"] == 2


def test_every_aim_is_judged(result: dict[str, Any]) -> None:
    aims = result["aims"]
    assert len(aims) == len(TRANSPORTS) * len(MESSAGES) + 1 + 2
    for aim in aims:
        assert isinstance(aim["met"], bool)
        assert aim["measured"] > 0 and aim["target"] > 0
    texts = [aim["name"] for aim in aims]
    for transport in TRANSPORTS:
        assert sum(f"over {transport}" in text for text in texts) == len(MESSAGES)
    assert "IPC throughput of a 8 MB tensor" in texts[-3]
    assert "(split-ipc) <= 1.1x co-located" in texts[-2]
    assert "KV move rank to rank over shared memory >= 1000 MB/s" in texts[-1]


def test_text_report_shows_every_row(result: dict[str, Any]) -> None:
    text = format_transport(result)
    rows = text.splitlines()
    for transport in TRANSPORTS:
        for message in MESSAGES:
            assert any(
                row.split("|")[:2] == [f"{transport:>9} ", f" {message:>9} "] for row in rows
            ), (transport, message)
    for label in ("1 MB", "8 MB"):
        for system in SYSTEM_ROWS:
            assert any(row.startswith(f"{label:>6} |") and f" {system} |" in row for row in rows), (
                label,
                system,
            )
    for placement in PLACEMENTS:
        assert any(row.startswith(f"{placement:>15} |") for row in rows), placement
    for layout in SPLITS[:2]:
        assert any(row.startswith(f"{layout:>10} |") for row in rows), layout
    for aim in result["aims"]:
        assert aim["name"] in text
    assert text.count("NOT met") == sum(not aim["met"] for aim in result["aims"])


def test_throughput_only_measures_tensors_alone() -> None:
    out = run_transport(quick=True, repeat=1, progress=quiet, throughput_only=True)
    check_report(out)
    assert rows(out, "latency") == [] and rows(out, "placement") == []
    assert rows(out, "split") == []
    throughput = rows(out, "throughput")
    assert [e["size_bytes"] for e in throughput] == [1 << 20, 8 << 20]
    assert len(out["aims"]) == 1 and "IPC throughput" in out["aims"][0]["name"]
    assert throughput[1]["systems"]["ipc"]["shared_memory"] is True
