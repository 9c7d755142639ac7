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
        help="decode tokens/s: runtime vs transformers generate vs a hand-written engine loop",
        description=(
            "Decode throughput of causal-lm (SmolLM2-135M by default) through the runtime, "
            "against transformers' generate (requests one after another) and a hand-written "
            "loop over the same engine, at several concurrencies. Default: the full workload "
            "(bf16 and fp32, 64-token prompts, 128 new tokens, N = 1, 8, 32, 3 repetitions)."
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
    transport.set_defaults(handler=_transport)


def _transport(args: argparse.Namespace, _: list[str]) -> int:
    try:
        _ensure_benchmarks()
        from benchmarks.transport import format_transport, run_transport

        report = run_transport(quick=args.quick, repeat=1 if args.quick else args.repeat)
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
