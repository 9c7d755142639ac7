"""qwen3-omni's mixture-of-experts layer: the batched experts against the per-expert loop.

Workload: one layer's routed experts (``decoder._Experts``) in float32 on the CPU, one torch
thread, run on ``tokens`` rows routed by a seeded random router, at two shapes:

- ``small``: the seeded ``small`` thinker's layer (8 experts, top-2, hidden 256, 128 wide);
- ``omni``: Qwen3-Omni-30B-A3B's routing (128 experts, top-8) at a quarter of its width
  (hidden 512, 192 wide), so a layer's weights fit a shared machine (150 MB).

Systems, on the same weights and inputs:

- ``batched``: the layer's forward: assignments sorted by expert, two grouped matmuls, one
  ``index_add_``; no loop over experts, no host sync;
- ``loop``: what the layer ran before (``expert_loop``): ``torch.unique(...).tolist()``, then per
  expert ``torch.where``, two matmuls and an indexed add, a host sync per expert on a GPU.

Each repetition times both back to back (order alternating) and the ratio ``loop/batched`` is
taken within it; both outputs are compared (max absolute difference).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mstar_async.bench.common import machine_info, quiet, ratio_table, summarize
from mstar_async.bench.report import make_report, system_entry
from mstar_async.models.qwen3_omni.decoder import Qwen3Config, SparseMoE

__all__ = ["SHAPES", "MoEConfig", "expert_loop", "format_report", "preset", "run_moe"]

Progress = Callable[[str], None]


def _shape(experts: int, top_k: int, hidden: int, width: int) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
    )


#: The layer shapes measured.
SHAPES = {"small": _shape(8, 2, 256, 128), "omni": _shape(128, 8, 512, 192)}


def expert_loop(
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """The experts as the layer ran them before: one pass per expert that some token picked.
    The baseline here and the reference of the layer's tests; never raises on valid shapes."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == expert)
        gate, up = F.linear(x[rows], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert])
        out[rows] += y * weights[rows, slot, None]
    return out


@dataclass(frozen=True)
class MoEConfig:
    """What to measure: layer shapes, token counts, repetitions, torch threads."""

    mode: str = "default"
    shapes: tuple[str, ...] = tuple(SHAPES)
    tokens: tuple[int, ...] = (1, 32, 512)
    repeat: int = 5
    threads: int = 1
    seed: int = 0


def preset(quick: bool) -> MoEConfig:
    """The default run (both shapes at 1, 32, 512 tokens, 5 repetitions) or ``quick`` (the
    small shape, 2 repetitions)."""
    return MoEConfig(mode="quick", shapes=("small",), repeat=2) if quick else MoEConfig()


def _layer(cfg: Qwen3Config, seed: int) -> SparseMoE:
    layer = SparseMoE(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return layer


def _time(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def _measure(name: str, tokens: int, config: MoEConfig, log: Progress) -> dict[str, Any]:
    cfg = SHAPES[name]
    layer = _layer(cfg, config.seed)
    gen = torch.Generator().manual_seed(config.seed + tokens)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    with torch.inference_mode():
        weights, experts = layer.gate(x)
    systems: dict[str, Callable[[], torch.Tensor]] = {
        "batched": lambda: layer.experts(x, weights, experts),
        "loop": lambda: expert_loop(
            layer.experts.gate_up_proj, layer.experts.down_proj, x, weights, experts
        ),
    }
    rounds: list[dict[str, float]] = []
    diff = 0.0
    with torch.inference_mode():
        for fn in systems.values():
            fn()  # warm up
        for index in range(config.repeat):
            order = list(systems) if index % 2 == 0 else list(systems)[::-1]
            measured: dict[str, float] = {}
            outs: dict[str, torch.Tensor] = {}
            for system in order:
                measured[system], outs[system] = _time(systems[system])
            diff = max(diff, float((outs["batched"] - outs["loop"]).abs().max()))
            rounds.append(measured)
    row: dict[str, Any] = {
        "shape": name,
        "tokens": tokens,
        "experts_used": int(torch.unique(experts).numel()),
        "batched_ms": summarize([r["batched"] * 1e3 for r in rounds]).to_json(),
        "loop_ms": summarize([r["loop"] * 1e3 for r in rounds]).to_json(),
        "loop/batched": ratio_table(rounds, [("loop", "batched")])["loop/batched"].to_json(),
        "max_abs_diff": diff,
    }
    log(
        f"{name} {tokens:>4} tokens: batched {row['batched_ms']['median']:.3f} ms, loop "
        f"{row['loop_ms']['median']:.3f} ms, loop/batched {row['loop/batched']['median']:.2f}x"
    )
    return row


def run_moe(config: MoEConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Measure both systems at every shape and token count; the report (the shape of
    ``mstar_async.bench.report``), one row per shape and token count.

    Sets torch's thread count to ``config.threads`` for the run and restores it after.

    Raises:
        ValueError: an unknown shape.
    """
    unknown = sorted(set(config.shapes) - SHAPES.keys())
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; shapes: {sorted(SHAPES)}")
    log = progress or quiet
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    machine = machine_info()
    try:
        rows = [_measure(n, t, config, log) for n in config.shapes for t in config.tokens]
    finally:
        torch.set_num_threads(threads)
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "moe",
        workload={
            "model": "qwen3-omni MoE layer (routed experts)",
            "mode": config.mode,
            "shapes": {
                n: {
                    "experts": SHAPES[n].num_experts,
                    "top_k": SHAPES[n].num_experts_per_tok,
                    "hidden": SHAPES[n].hidden_size,
                    "width": SHAPES[n].moe_intermediate_size,
                }
                for n in config.shapes
            },
            "tokens": list(config.tokens),
            "repeat": config.repeat,
            "torch_threads": config.threads,
            "dtype": "float32",
            "device": "cpu",
        },
        machine=machine,
        systems=[
            system_entry("batched", "sorted by expert, two grouped matmuls, one index_add_"),
            system_entry("loop", "per expert: where, two matmuls, an indexed add (before)"),
        ],
        results=rows,
        aims=[],
        seconds=time.perf_counter() - started,
    )


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    w = report["workload"]
    lines = [
        f"moe: {w['dtype']} on {w['device']}, {w['torch_threads']} torch thread(s), "
        f"{w['repeat']} repetition(s)",
        "shape  tokens  experts used  batched ms  loop ms  loop/batched (min-max)  max diff",
    ]
    for r in report["results"]:
        ratio = r["loop/batched"]
        lines.append(
            f"{r['shape']:<6} {r['tokens']:>6} {r['experts_used']:>13} "
            f"{r['batched_ms']['median']:>11.3f} {r['loop_ms']['median']:>8.3f} "
            f"{ratio['median']:>9.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}) "
            f"{r['max_abs_diff']:>9.1e}"
        )
    return "\n".join(lines)
