"""``mstar bench decode``: decode throughput of the runtime against its baselines.

The measuring code lives in the top-level ``benchmarks`` package of the source checkout, which
the wheel does not ship (``pyproject.toml`` packages ``mstar_async*`` only) and an editable
install does not map. So this module finds it: when this file sits in a checkout
(``<root>/mstar_async/cli/bench.py`` with ``<root>/benchmarks/decode.py`` beside it), ``<root>``
goes onto the front of ``sys.path`` (unless already there); otherwise an importable
``benchmarks`` is used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mstar_async.errors import MstarError

#: The repository root when this file is part of a source checkout.
_CHECKOUT = Path(__file__).resolve().parents[2]


def _ensure_benchmarks() -> None:
    """Make ``benchmarks.decode`` importable, or say why it cannot be.

    Raises:
        MstarError: neither a checkout's ``benchmarks`` nor an importable one exists (an
            installed wheel rather than a checkout).
    """
    if (_CHECKOUT / "benchmarks" / "decode.py").is_file():
        # The checkout's own benchmarks, even if some other top-level "benchmarks" is
        # installed: they must measure the mstar_async they sit beside.
        if str(_CHECKOUT) not in sys.path:
            sys.path.insert(0, str(_CHECKOUT))
        return
    if importlib.util.find_spec("benchmarks") is None:
        raise MstarError(
            "the benchmarks ship with the source checkout, not the package: run 'mstar bench' "
            "from a checkout (pip install -e .)"
        )


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,8,32, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


_DTYPE_CHOICES = {"bf16": ("bfloat16",), "fp32": ("float32",), "both": ("bfloat16", "float32")}


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` (with its benchmarks as subcommands) to the ``mstar`` subcommands."""
    bench = sub.add_parser(
        "bench",
        help="measure the runtime against baselines",
        description="Benchmarks. Progress goes to stderr; results (or --json) to stdout.",
    )
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    decode = kinds.add_parser(
        "decode",
        help=(
            "decode tokens/s: runtime (in process and in one worker process) vs transformers "
            "generate vs a hand-written engine loop"
        ),
        description=(
            "Decode throughput of causal-lm (SmolLM2-135M by default) through the runtime, in "
            "this process and with its engine in one worker process, against transformers' "
            "generate (requests one after another) and a hand-written loop over the same "
            "engine, at several concurrencies. Default: the full workload (bf16 and fp32, "
            "64-token prompts, 128 new tokens, N = 1, 8, 32, 3 repetitions)."
        ),
    )
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
    decode.add_argument("--dtype", choices=sorted(_DTYPE_CHOICES), help="default: both")
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
        type=int,
        help="times a repetition disturbed by other processes is measured again (2; --quick: 0)",
    )
    decode.add_argument(
        "--folder", type=Path, help="a Llama/Qwen2 checkpoint folder (default: SmolLM2-135M)"
    )
    decode.set_defaults(handler=_decode)
    transport = kinds.add_parser(
        "transport",
        help="ZeroMQ round trips and tensor throughput vs raw pyzmq and memory copies",
        description=(
            "Small-message round trips (IPC, TCP) against raw pyzmq, tensor throughput (1 MB, "
            "64 MB) against a memory copy, and a streaming speech request of the demo model "
            "(first audio, last audio, total) at each placement: in-process, one worker, codec "
            "split, codec replicas, and codec split with ranks joined over TCP (mstar worker)."
        ),
    )
    transport.add_argument(
        "--quick",
        action="store_true",
        help="fewer round trips, 8 MB tensors, 2 requests per placement",
    )
    transport.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    transport.add_argument("--repeat", type=_positive, default=3, help="repetitions (3)")
    transport.add_argument(
        "--throughput-only",
        action="store_true",
        help="only the tensor throughput measurement (no round trips, no placements)",
    )
    transport.set_defaults(handler=_transport)
    _add_rollout_parser(kinds)
    _add_vla_parser(kinds)
    _add_image_parser(kinds)
    _add_speech_parser(kinds)
    _add_overhead_parser(kinds)


def _add_rollout_parser(kinds: Any) -> None:
    rollout = kinds.add_parser(
        "rollout",
        help="world-model rollout: KV-cached DynamicLoop vs recomputing the context each step",
        description=(
            "Seconds per vjepa2 rollout (small size) through the runtime with the predictor's "
            "KV cache, against the reference loop that re-runs the predictor over the whole "
            "growing context every step, at horizons 4, 8, 16, 30 (3 repetitions)."
        ),
    )
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
    rollout.set_defaults(handler=_rollout)


def _rollout(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from dataclasses import replace

        from benchmarks.common import ProgressLog
        from benchmarks.rollout import format_rollout, plot_rollout, preset, run_rollout

        config = preset("quick" if args.quick else "default")
        changes = {
            "horizons": args.horizons,
            "repeat": args.repeat,
            "threads": args.threads,
            "size": args.size,
        }
        config = replace(config, **{k: v for k, v in changes.items() if v is not None})
        if args.image_size is not None:
            config = replace(config, overrides={"image_size": args.image_size})
        report = run_rollout(config, ProgressLog())
    except MstarError as exc:
        print(f"mstar bench rollout: {exc}", file=sys.stderr)
        return 2
    if args.plot is not None:
        skipped = plot_rollout(report, args.plot)
        print(skipped or f"plot written to {args.plot}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_rollout(report))
    return 0


def _add_vla_parser(kinds: Any) -> None:
    vla = kinds.add_parser(
        "vla",
        help="pi05 action-chunk latency: concurrent requests vs one after another",
        description=(
            "Action-chunk latency p50/p95 and chunks/s of the pi05 policy (small) at 1, 4 and "
            "16 concurrent requests through the runtime, against the same requests one after "
            "another, 3 repetitions."
        ),
    )
    vla.add_argument("--quick", action="store_true", help="the tiny model, 1 repetition")
    vla.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    vla.add_argument("--concurrency", type=_concurrency, help="comma-separated (1,4,16)")
    vla.add_argument("--repeat", type=_positive, help="repetitions (3; --quick: 1)")
    vla.add_argument("--steps", type=_positive, help="flow-matching steps per chunk (10)")
    vla.add_argument("--size", choices=("tiny", "small"), help="model size (small; --quick: tiny)")
    vla.add_argument("--threads", type=_positive, help="torch intra-op threads (1)")
    vla.set_defaults(handler=_vla)


def _vla(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from dataclasses import replace

        from benchmarks.common import ProgressLog
        from benchmarks.vla import format_vla, preset, run_vla_sync

        config = preset(args.quick)
        changes = {
            "concurrency": args.concurrency,
            "repeat": args.repeat,
            "steps": args.steps,
            "size": args.size,
            "threads": args.threads,
        }
        config = replace(config, **{k: v for k, v in changes.items() if v is not None})
        report = run_vla_sync(config, ProgressLog())
    except MstarError as exc:
        print(f"mstar bench vla: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_vla(report))
    return 0


def _add_image_parser(kinds: Any) -> None:
    image = kinds.add_parser(
        "image",
        help="bagel p50 latency: forked-KV CFG vs dense-concatenation CFG vs sequential branches",
        description=(
            "End-to-end p50 latency of the bagel model for text-to-image and editing at several "
            "concurrencies, with its CFG branches as forks of the prompt's paged KV, as dense "
            "concatenation (each branch recomputes its context every step) and one after another."
        ),
    )
    image.add_argument("--quick", action="store_true", help="N=1,2, 3 steps, 1 repetition")
    image.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    image.add_argument("--size", choices=("tiny", "small"), help="model size (small)")
    image.add_argument("--concurrency", type=_concurrency, help="request counts (1,2,4,8)")
    image.add_argument("--steps", type=_positive, help="denoising steps (8)")
    image.add_argument("--repeat", type=_positive, help="repetitions (3)")
    image.add_argument("--threads", type=_positive, help="torch intra-op threads (1)")
    image.add_argument("--plot", type=Path, help="also draw the figures to this PNG (matplotlib)")
    image.set_defaults(handler=_image)


def _image(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.common import ProgressLog
        from benchmarks.image import configure, format_report, plot_report, preset, run_image_sync

        config = configure(
            preset(args.quick),
            size=args.size,
            concurrency=args.concurrency,
            steps=args.steps,
            repeat=args.repeat,
            threads=args.threads,
        )
        report = run_image_sync(config, ProgressLog())
        if args.plot is not None:
            plot_report(report, str(args.plot))
    except MstarError as exc:
        print(f"mstar bench image: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_speech_parser(kinds: Any) -> None:
    speech = kinds.add_parser(
        "speech",
        help="streaming TTS: TTFA, RTF, underruns vs non-streaming, a stage pipeline, sequential",
        description=(
            "Time to first audio, RTF p50/p95, audio seconds per wall second and playback "
            "underruns of orpheus (small) at 1, 4 and 16 concurrent requests through the "
            "runtime, against (a) all codes first then the codec, in one process, (b) a "
            "two-process LM stage -> codec stage pipeline without chunking, (c) the same "
            "requests one after another. qwen3-omni (--model) runs the runtime and (c) only."
        ),
    )
    speech.add_argument("--quick", action="store_true", help="tiny model, N=1,4, short requests")
    speech.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    speech.add_argument("--model", choices=("orpheus", "qwen3-omni"), default="orpheus")
    speech.add_argument("--size", choices=("tiny", "small"), help="model size (small)")
    speech.add_argument("--concurrency", type=_concurrency, help="comma-separated (1,4,16)")
    speech.add_argument(
        "--max-tokens", type=_positive, help="speech tokens per request (orpheus: 211 = 2.56 s)"
    )
    speech.add_argument("--threads", type=_positive, help="torch threads per process (1)")
    speech.add_argument("--plot", type=Path, help="also draw RTF and TTFA to this PNG")
    speech.set_defaults(handler=_speech)


def _speech(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.common import ProgressLog
        from benchmarks.speech import configure, format_report, plot_report, preset, run_speech_sync

        config = configure(
            preset(args.quick, args.model),
            size=args.size,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            threads=args.threads,
        )
        report = run_speech_sync(config, ProgressLog())
        if args.plot is not None and not plot_report(report, args.plot):
            print("matplotlib is not installed: no plot", file=sys.stderr)
    except (MstarError, ValueError) as exc:
        print(f"mstar bench speech: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


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
    overhead = kinds.add_parser(
        "overhead",
        help="control-plane cost per request-iteration, with engines that do no work",
        description=(
            "Microseconds per request per loop iteration and engine forwards per second of the "
            "noop model (a DynamicLoop over an engine that does no work, or sleeps 2 ms per "
            "forward) in process, on one worker process and on two, at N = 1, 32, 128 "
            "concurrent requests of K = 200 iterations, 3 repetitions."
        ),
    )
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
    overhead.set_defaults(handler=_overhead)


def _overhead(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.common import ProgressLog
        from benchmarks.overhead import configure, format_report, preset, run_overhead_sync

        config = configure(
            preset(args.quick),
            concurrency=args.concurrency,
            iterations=args.iterations,
            repeat=args.repeat,
            systems=args.systems,
            engines=args.engines,
        )
        report = run_overhead_sync(config, ProgressLog())
    except MstarError as exc:
        print(f"mstar bench overhead: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _transport(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.transport import format_transport, run_transport

        report = run_transport(
            quick=args.quick,
            repeat=1 if args.quick else args.repeat,
            throughput_only=args.throughput_only,
        )
    except MstarError as exc:
        print(f"mstar bench transport: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_transport(report))
    return 0


def _decode(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.decode import configure, format_report, preset, run_decode_sync

        base = preset("quick" if args.quick else "full" if args.full else "default")
        config = configure(
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
        report = run_decode_sync(config)
    except MstarError as exc:
        print(f"mstar bench decode: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
