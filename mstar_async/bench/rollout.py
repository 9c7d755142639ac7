"""World-model rollout: the KV-cached predictor through the runtime against recomputing.

Workload: the ``vjepa2`` model at ``small`` size (128-px frames of 16-px patches: 64 latent
tokens plus an action and a state token per frame, a 4-layer 192-wide predictor, one context
frame), fp32, one request at a time, rolled out to horizons 4, 8, 16 and 30. Two systems
compute the same predictions from the same seeded inputs and weights:

- ``cached``: ``runtime.generate(horizon=H, ...)`` on ``open_runtime(build_model("vjepa2"))``:
  the encoder, a prefill of the context, then a ``DynamicLoop`` whose every step computes only
  the new frame's tokens against the request's KV cache. Timed from the request's submission
  to its last ``LatentOutput``.
- ``recompute``: the reference loop (``recompute_rollout``): encode, then at every step run the
  predictor over the whole growing context and keep the last frame's prediction, as upstream's
  planner does. Plain torch in this thread: no runtime overhead at all.

At step ``t`` the reference computes ``context + t`` frames where the cache computes one, so
over ``H`` steps the frames computed grow as ``H**2 / 2`` against ``H`` (the report lists
both counts), and attention over the longer contexts widens the gap further.

Each repetition runs both systems back to back (order alternating), and the speedup is taken
within a repetition. Torch runs one thread by default: on a shared machine two threads
competing with other processes measured up to 10x slower, which would measure the neighbour.
Both systems' predictions are compared (max absolute difference, fp32).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from mstar_async.bench.common import (
    cpu_sample,
    foreign_cores,
    machine_info,
    quiet,
    ratio_table,
    summarize,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.errors import MstarError
from mstar_async.models import build_model
from mstar_async.models.vjepa2 import (
    VJEPA2Config,
    make_config,
    random_inputs,
    recompute_rollout,
)
from mstar_async.models.vjepa2.engines import seeded
from mstar_async.models.vjepa2.modules import ACPredictor, VisionEncoder
from mstar_async.outputs import LatentOutput
from mstar_async.runtime import Runtime, open_runtime

__all__ = [
    "AIM_HORIZON",
    "AIM_SPEEDUP",
    "RolloutConfig",
    "format_rollout",
    "plot_rollout",
    "preset",
    "run_rollout",
]

Progress = Callable[[str], None]

#: The paper's figure for KV-cached against recomputed rollouts, at its horizon.
AIM_SPEEDUP = 12.5
AIM_HORIZON = 30
#: Largest absolute difference allowed between the two systems' predictions (fp32).
AGREEMENT = 1e-3


class RolloutBenchmarkError(MstarError):
    """The two systems disagreed, or a rollout did not produce its horizon."""


@dataclass(frozen=True)
class RolloutConfig:
    """What to measure: model size, horizons, repetitions, torch threads."""

    mode: str = "default"
    size: str = "small"
    horizons: tuple[int, ...] = (4, 8, 16, 30)
    repeat: int = 3
    threads: int = 1
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)


def preset(mode: str) -> RolloutConfig:
    """``default`` (horizons 4, 8, 16, 30; 3 repetitions) or ``quick`` (4, 8, 16; one).

    Raises:
        ValueError: an unknown mode.
    """
    if mode == "default":
        return RolloutConfig()
    if mode == "quick":
        return RolloutConfig(mode="quick", horizons=(4, 8, 16), repeat=1)
    raise ValueError(f"unknown rollout preset {mode!r}; presets: default, quick")


async def _cached(runtime: Runtime, horizon: int, seed: int) -> tuple[float, list[torch.Tensor]]:
    started = time.perf_counter()
    async with runtime.generate(horizon=horizon, seed=seed) as outputs:
        latents = [item.latent async for item in outputs if isinstance(item, LatentOutput)]
    elapsed = time.perf_counter() - started
    if len(latents) != horizon:
        raise RolloutBenchmarkError(f"horizon {horizon}: the runtime made {len(latents)} frames")
    return elapsed, latents


def _recompute(
    models: tuple[VisionEncoder, ACPredictor], cfg: VJEPA2Config, horizon: int, seed: int
) -> tuple[float, list[torch.Tensor]]:
    started = time.perf_counter()
    latents = recompute_rollout(models[0], models[1], random_inputs(cfg, horizon, seed))
    return time.perf_counter() - started, latents


def _frames(context: int, horizon: int) -> dict[str, int]:
    """Predictor frames each system computes for one rollout."""
    return {
        "cached": context + horizon - 1,
        "recompute": sum(context + t for t in range(horizon)),
    }


async def _measure(config: RolloutConfig, progress: Progress) -> dict[str, Any]:
    cfg = make_config(config.size, **config.overrides)
    models = seeded(cfg)
    model = build_model("vjepa2", size=config.size, **config.overrides)
    entries = []
    async with open_runtime(model) as runtime:
        await _cached(runtime, 2, config.seed)  # warm up both paths
        _recompute(models, cfg, 2, config.seed)
        for horizon in config.horizons:
            rounds: list[dict[str, float]] = []
            worst = 0.0
            disturbed: list[float] = []
            for rep in range(config.repeat):
                start = cpu_sample()
                order = ("cached", "recompute") if rep % 2 == 0 else ("recompute", "cached")
                measured: dict[str, float] = {}
                outputs: dict[str, list[torch.Tensor]] = {}
                for system in order:
                    if system == "cached":
                        seconds, latents = await _cached(runtime, horizon, config.seed + rep)
                    else:
                        seconds, latents = _recompute(models, cfg, horizon, config.seed + rep)
                    measured[system], outputs[system] = seconds, latents
                pairs = zip(outputs["cached"], outputs["recompute"], strict=True)
                worst = max(worst, *(float((a - b).abs().max()) for a, b in pairs))
                others = foreign_cores(start, cpu_sample())
                disturbed.append(-1.0 if others is None else others)
                rounds.append(measured)
                progress(
                    f"horizon {horizon} rep {rep + 1}: cached {measured['cached']:.3f} s, "
                    f"recompute {measured['recompute']:.3f} s"
                )
            if worst > AGREEMENT:
                raise RolloutBenchmarkError(
                    f"horizon {horizon}: cached and recomputed predictions differ by {worst:.2e}"
                )
            ratio = ratio_table(rounds, [("recompute", "cached")])["recompute/cached"]
            entries.append(
                {
                    "horizon": horizon,
                    "cached_s": summarize([r["cached"] for r in rounds]).to_json(),
                    "recompute_s": summarize([r["recompute"] for r in rounds]).to_json(),
                    "speedup": ratio.to_json(),
                    "frames": _frames(cfg.context_frames, horizon),
                    "max_abs_diff": worst,
                    "foreign_cores": [round(x, 2) for x in disturbed],
                }
            )
    return {"cfg": cfg, "entries": entries}


def run_rollout(config: RolloutConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Measure both systems at every horizon; the report (the shape of
    ``mstar_async.bench.report``), one row per horizon.

    Sets torch's thread count to ``config.threads`` for the run and restores it after.

    Raises:
        RolloutBenchmarkError: the systems disagree beyond ``AGREEMENT`` or a rollout came
            back short.
    """
    log = progress or quiet
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    machine = machine_info()
    try:
        measured = anyio.run(_measure, config, log)
    finally:
        torch.set_num_threads(threads)
    machine["load_average_end"] = machine_info()["load_average"]
    cfg = measured["cfg"]
    entries: list[dict[str, Any]] = measured["entries"]
    return make_report(
        "rollout",
        workload={
            "model": "vjepa2",
            "mode": config.mode,
            "size": config.size,
            "horizons": list(config.horizons),
            "repeat": config.repeat,
            "torch_threads": config.threads,
            "image_size": cfg.image_size,
            "patch_size": cfg.patch_size,
            "latent_tokens_per_frame": cfg.patches_per_frame,
            "predictor_tokens_per_frame": cfg.tokens_per_frame,
            "context_frames": cfg.context_frames,
            "encoder": f"{cfg.encoder_depth} x {cfg.encoder_dim}, {cfg.encoder_heads} heads",
            "predictor": f"{cfg.predictor_depth} x {cfg.predictor_dim}, "
            f"{cfg.predictor_heads} heads",
            "dtype": "float32",
        },
        machine=machine,
        systems=[
            system_entry(
                "cached",
                "runtime.generate(horizon=H) on open_runtime(vjepa2): a KV-cached DynamicLoop, "
                "one new frame per step",
            ),
            system_entry(
                "recompute",
                "recompute_rollout: the predictor over the whole growing context every step",
            ),
        ],
        results=entries,
        aims=[_aim(entries)],
        seconds=time.perf_counter() - started,
    )


def _aim(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The paper's speedup at its horizon, or not measured when that horizon was not run."""
    at = next((e for e in entries if e["horizon"] == AIM_HORIZON), None)
    return aim_entry(
        f"recompute/cached >= {AIM_SPEEDUP:g}x at horizon {AIM_HORIZON}",
        AIM_SPEEDUP,
        None if at is None else at["speedup"]["median"],
        horizon=AIM_HORIZON,
        ratio="recompute/cached",
    )


def format_rollout(report: dict[str, Any]) -> str:
    """The report as a text table."""
    w = report["workload"]
    lines = [
        f"rollout: vjepa2 {w['size']} ({w['predictor_tokens_per_frame']} predictor tokens per "
        f"frame, predictor {w['predictor']}), {w['repeat']} repetition(s), "
        f"{w['torch_threads']} torch thread(s)",
        "horizon  cached s  recompute s  speedup (min-max)  frames cached/recompute",
    ]
    for e in report["results"]:
        s = e["speedup"]
        lines.append(
            f"{e['horizon']:>7}  {e['cached_s']['median']:>8.3f}  "
            f"{e['recompute_s']['median']:>11.3f}  {s['median']:>6.1f}x ({s['min']:.1f}-"
            f"{s['max']:.1f})  {e['frames']['cached']:>6}/{e['frames']['recompute']}"
        )
    for entry in report["aims"]:
        if entry["measured"] is None:
            verdict = f"not measured (horizon {entry['horizon']} not in this run)"
        else:
            verdict = f"{entry['measured']:.1f}x: {'met' if entry['met'] else 'NOT met'}"
        lines.append(f"aim {entry['name']}: {verdict}")
    return "\n".join(lines)


def plot_rollout(report: dict[str, Any], path: Path) -> str | None:
    """Draw seconds per rollout and the speedup against horizon into ``path`` (PNG).

    Returns ``None`` when drawn, or why not (matplotlib is not installed).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot drawn"
    entries: Sequence[dict[str, Any]] = report["results"]
    horizons = [e["horizon"] for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("recompute_s", "recompute every step"), ("cached_s", "KV-cached loop")):
        left.plot(horizons, [e[key]["median"] for e in entries], marker="o", label=label)
    left.set_xlabel("horizon (frames)")
    left.set_ylabel("seconds per rollout")
    left.set_yscale("log")
    left.legend()
    right.plot(horizons, [e["speedup"]["median"] for e in entries], marker="o", label="measured")
    right.axhline(AIM_SPEEDUP, linestyle="--", color="gray", label=f"aim {AIM_SPEEDUP}x")
    right.set_xlabel("horizon (frames)")
    right.set_ylabel("speedup (recompute / cached)")
    right.legend()
    w = report["workload"]
    fig.suptitle(f"vjepa2 {w['size']} rollout, {w['predictor_tokens_per_frame']} tokens per frame")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
