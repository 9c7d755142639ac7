"""Loading a Qwen3-Omni checkpoint per rank: peak memory, bytes read and time.

Workload: a synthetic checkpoint folder in the released layout (``omni_folder``: bfloat16,
about 15 shards, per-expert matrices, audio and vision towers) of ``size_gb``, written to a
temporary folder and read back warm from the page cache, loaded in bfloat16 on the CPU with one
torch thread by default (on a shared machine two threads' copies spin-wait: the same load
measured 0.2 s to 3 s). Each
measurement runs in a fresh process (``python -m mstar_async.bench.load``), which resets its
peak RSS after its imports, loads, and reports how far the peak rose. Systems:

- ``streamed``: what a rank does now (``OmniWeights``): each part its engines need, built on
  the meta device and streamed tensor by tensor into bfloat16; one row per rank layout:
  ``all`` (every engine on one rank), ``thinker``, ``talker`` (the talker's and the code
  predictor's engines: talker and code predictor, nothing of the thinker) and ``code2wav``.
- ``eager``: what every rank did before: read the whole checkpoint into memory, stack the
  experts into a second copy, build every part in float32 with default initialisation, load,
  then cast to bfloat16.

The aims: for each streamed rank, the peak grows by at most 1.3x the rank's weights plus 200 MB;
the talker's rank reads no byte of the thinker's tensors.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar_async.bench.common import machine_info, quiet
from mstar_async.bench.omni_folder import OmniFolder, write_omni_folder
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.errors import MstarError

# Imported here, not when loading: the measuring process's baseline is taken after its imports.
from mstar_async.models import build_model
from mstar_async.models.checkpoints import load_checkpoint, read_config
from mstar_async.models.qwen3_omni.code2wav import Code2Wav
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import OmniWeights, build_talker

__all__ = [
    "RANKS",
    "LoadConfig",
    "format_report",
    "measure_in_child",
    "preset",
    "run_load",
]

Progress = Callable[[str], None]

#: The parts each rank layout's engines ask ``OmniWeights`` for, in the order engines are built.
RANKS: dict[str, tuple[str, ...]] = {
    "all": ("thinker", "talker", "code_predictor", "code2wav"),
    "thinker": ("thinker",),
    "talker": ("talker", "code_predictor"),
    "code2wav": ("code2wav",),
}
#: Every tensor a rank holding all engines needs (everything but the towers).
_MODEL_PREFIXES = ("thinker.model.", "thinker.lm_head.", "talker.", "code2wav.")
_RANK_PREFIXES = {
    "all": _MODEL_PREFIXES,
    "thinker": ("thinker.model.", "thinker.lm_head."),
    "talker": ("talker.",),
    "code2wav": ("code2wav.",),
}
AIM_FACTOR, AIM_SLACK = 1.3, 200 * 2**20


class LoadBenchmarkError(MstarError):
    """A measuring process failed, or this system cannot reset its peak RSS (not Linux)."""


@dataclass(frozen=True)
class LoadConfig:
    """What to measure: checkpoint size, rank layouts, whether to run the eager baseline, torch
    threads of the measuring processes."""

    mode: str = "default"
    size_gb: float = 2.0
    ranks: tuple[str, ...] = tuple(RANKS)
    eager: bool = True
    threads: int = 1


def preset(quick: bool) -> LoadConfig:
    """The default run (2 GB, every rank layout, the baseline) or ``quick`` (0.25 GB)."""
    return LoadConfig(mode="quick", size_gb=0.25) if quick else LoadConfig()


def rank_bytes(folder: OmniFolder, rank: str) -> int:
    """Bytes of the weights rank layout ``rank`` holds (bfloat16, as stored)."""
    return folder.bytes_under(*_RANK_PREFIXES[rank])


# ------------------------------------------------------------------ the measuring process


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LoadBenchmarkError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS (Linux: 5 to clear_refs); the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError as exc:
        raise LoadBenchmarkError(f"cannot reset the peak RSS: {exc}") from exc
    return _status_bytes("VmRSS")


def _streamed(folder: Path, parts: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    weights = OmniWeights(OmniConfig.from_hf(read_config(folder)), folder, torch.bfloat16, "cpu")
    held = [getattr(weights, part)() for part in parts]
    loads = [
        {
            "part": part,
            "tensors": stats.tensors,
            "bytes_read": stats.bytes,
            "parameter_bytes": stats.parameter_bytes,
            "seconds": round(stats.seconds, 4),
        }
        for part, stats in weights.loads
    ]
    names = [name for _, stats in weights.loads for name in stats.names]
    return held, {"loads": loads, "names_read": names}


def _engines(folder: Path, engines: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    model = build_model("qwen3-omni", path=folder, dtype="bfloat16", kv_cache_bytes=4 * 2**20)
    return [model.components[engine]() for engine in engines], {}


_FUSED = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _eager(folder: Path, parts: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """Loading as every rank did before streaming (the parts asked for are ignored)."""
    checkpoint = load_checkpoint(folder)
    read = sum(t.numel() * t.element_size() for t in checkpoint.state_dict.values())
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in checkpoint.state_dict.items():
        match = _FUSED.match(key)
        if match is None:
            state[key] = value
        else:
            stack = experts.setdefault(match.group(1), {}).setdefault(match.group(3), {})
            stack[int(match.group(2))] = value
    for prefix, mats in experts.items():
        count = len(mats["down_proj"])
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([mats["gate_proj"][e], mats["up_proj"][e]]) for e in range(count)]
        )
        state[f"{prefix}.down_proj"] = torch.stack([mats["down_proj"][e] for e in range(count)])
    cfg = OmniConfig.from_hf(checkpoint.config)
    modules = {
        "thinker.": Thinker(cfg.thinker, cfg.thinker_vocab),
        "talker.": build_talker(cfg),
        "code2wav.": Code2Wav(cfg.code2wav),
    }
    for prefix, module in modules.items():
        mine = {
            k[len(prefix) :]: v
            for k, v in state.items()
            if k.startswith(prefix) and not k.startswith(("thinker.audio", "thinker.visual"))
        }
        module.load_state_dict(mine, strict=True)
        module.to(torch.bfloat16)
    return list(modules.values()), {"bytes_read": read, "tensors": len(checkpoint.state_dict)}


_HOW = {"streamed": _streamed, "engines": _engines, "eager": _eager}


def _child(how: str, folder: str, items: list[str], threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    baseline = _reset_peak()
    started = time.perf_counter()
    held, facts = _HOW[how](Path(folder), items)
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    assert held  # what was loaded stays alive until the peak is read
    return {"baseline_rss": baseline, "peak_rss": peak, "seconds": seconds, **facts}


def measure_in_child(
    how: str, folder: Path, items: Sequence[str], *, threads: int = 1
) -> dict[str, Any]:
    """Load in a fresh process and report how far its peak RSS rose over its RSS after its
    imports (``peak_rss - baseline_rss``), and the seconds loading took.

    ``how``: ``streamed`` (``items`` are ``OmniWeights`` parts; also reports each part's
    ``loads`` and the ``names_read``), ``engines`` (``items`` are engines of
    ``build_model("qwen3-omni", path=folder)``, 4 MB of KV each) or ``eager`` (the old way;
    ``items`` ignored), on ``threads`` torch threads. Blocks until the process ends.

    Raises:
        LoadBenchmarkError: the process failed (its stderr's end is in the message).
    """
    spec = json.dumps({"how": how, "folder": str(folder), "items": list(items), "threads": threads})
    done = subprocess.run(
        [sys.executable, "-m", "mstar_async.bench.load", spec],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise LoadBenchmarkError(f"loading ({how} {list(items)}) failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


# ------------------------------------------------------------------ the benchmark


def _row(system: str, rank: str, folder: OmniFolder, measured: dict[str, Any]) -> dict[str, Any]:
    weights = rank_bytes(folder, rank)
    growth = measured["peak_rss"] - measured["baseline_rss"]
    loads = measured.get("loads")
    read = sum(x["bytes_read"] for x in loads) if loads else measured["bytes_read"]
    tensors = sum(x["tensors"] for x in loads) if loads else measured["tensors"]
    thinker = (
        sum(folder.sizes[n] for n in measured["names_read"] if n.startswith("thinker."))
        if loads is not None
        else None
    )
    return {
        "system": system,
        "rank": rank,
        "parts": list(RANKS[rank]) if system == "streamed" else ["everything"],
        "weights_bytes": weights,
        "bytes_read": read,
        "tensors_read": tensors,
        "thinker_bytes_read": thinker,
        "seconds": round(measured["seconds"], 4),
        "peak_rss_growth_bytes": growth,
        "growth_over_weights": round(growth / weights, 3),
        "loads": loads or [],
    }


def run_load(config: LoadConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Write the checkpoint, measure each rank layout (and the baseline) in its own process;
    the report (the shape of ``mstar_async.bench.report``), one row per system and rank.

    Raises:
        ValueError: an unknown rank layout, or a size below 64 MB.
        LoadBenchmarkError: a measuring process failed.
    """
    log = progress or quiet
    unknown = sorted(set(config.ranks) - RANKS.keys())
    if unknown:
        raise ValueError(f"unknown rank layouts {unknown}; layouts: {sorted(RANKS)}")
    started = time.perf_counter()
    machine = machine_info()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mstar-load-") as tmp:
        log(f"writing a {config.size_gb:g} GB checkpoint to {tmp}")
        folder = write_omni_folder(Path(tmp) / "qwen3-omni", int(config.size_gb * 2**30))
        stored = sum(folder.sizes.values())
        runs = [("streamed", rank) for rank in config.ranks]
        runs += [("eager", "all")] if config.eager else []
        for system, rank in runs:
            log(f"{system} {rank}: loading {rank_bytes(folder, rank) / 2**20:.0f} MB of weights")
            measured = measure_in_child(system, folder.path, RANKS[rank], threads=config.threads)
            row = _row(system, rank, folder, measured)
            log(
                f"{system} {rank}: {row['seconds']:.2f} s, read {row['bytes_read'] / 2**20:.0f} "
                f"MB, peak RSS +{row['peak_rss_growth_bytes'] / 2**20:.0f} MB "
                f"({row['growth_over_weights']:.2f}x the weights)"
            )
            rows.append(row)
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "load",
        workload={
            "model": "qwen3-omni (synthetic checkpoint, released layout)",
            "mode": config.mode,
            "size_gb": config.size_gb,
            "checkpoint_bytes": stored,
            "tensors": len(folder.sizes),
            "dtype": "bfloat16 (stored and loaded)",
            "device": "cpu",
            "page_cache": "warm (the folder was just written)",
            "torch_threads": config.threads,
            "ranks": {rank: list(RANKS[rank]) for rank in config.ranks},
        },
        machine=machine,
        systems=[
            system_entry(
                "streamed",
                "OmniWeights: the rank's parts on the meta device, streamed tensor by tensor",
            ),
            system_entry(
                "eager",
                "before: the whole checkpoint in memory, experts stacked, fp32 modules, cast",
            ),
        ][: 2 if config.eager else 1],
        results=rows,
        aims=[_aim(row) for row in rows if row["system"] == "streamed"] + _talker_aim(rows),
        seconds=time.perf_counter() - started,
    )


def _aim(row: dict[str, Any]) -> dict[str, Any]:
    bound = AIM_FACTOR * row["weights_bytes"] + AIM_SLACK
    return aim_entry(
        f"{row['rank']}: peak RSS growth <= {AIM_FACTOR:g}x weights + 200 MB (MB)",
        round(bound / 2**20, 1),
        round(row["peak_rss_growth_bytes"] / 2**20, 1),
        compare="<=",
        rank=row["rank"],
    )


def _talker_aim(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The talker's rank reads none of the thinker's tensors."""
    return [
        aim_entry(
            "talker: thinker bytes read",
            0,
            row["thinker_bytes_read"],
            compare="<=",
            rank="talker",
        )
        for row in rows
        if row["system"] == "streamed" and row["rank"] == "talker"
    ]


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    w = report["workload"]
    lines = [
        f"load: {w['checkpoint_bytes'] / 2**30:.2f} GB checkpoint ({w['tensors']} tensors), "
        f"{w['dtype']}, {w['page_cache']}",
        "system    rank      weights MB  read MB  tensors  thinker MB  seconds  peak +MB  x wts",
    ]
    for r in report["results"]:
        thinker = (
            "-" if r["thinker_bytes_read"] is None else f"{r['thinker_bytes_read'] / 2**20:.0f}"
        )
        lines.append(
            f"{r['system']:<9} {r['rank']:<9} {r['weights_bytes'] / 2**20:>10.0f} "
            f"{r['bytes_read'] / 2**20:>8.0f} {r['tensors_read']:>8} {thinker:>11} "
            f"{r['seconds']:>8.2f} {r['peak_rss_growth_bytes'] / 2**20:>9.0f} "
            f"{r['growth_over_weights']:>6.2f}"
        )
    for aim in report["aims"]:
        verdict = "met" if aim["met"] else "NOT met"
        lines.append(f"aim {aim['name']}: {aim['measured']:g} <= {aim['target']:g}, {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    print(json.dumps(_child(_spec["how"], _spec["folder"], _spec["items"], _spec["threads"])))
