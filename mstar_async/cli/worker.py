"""``mstar worker --conductor tcp://HOST:PORT --rank N``: serve one rank of a runtime that runs
on another host (see ``mstar_async.worker.remote`` and docs/processes.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mstar_async.cli.keys import add_curve_keys_option, load_curve_keys
from mstar_async.errors import MstarError


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return value


def _builder(text: str) -> str:
    module, _, function = text.partition(":")
    if not module or not function:
        raise argparse.ArgumentTypeError(f"expected MODULE:FUNCTION, got {text!r}")
    return text


def add_worker_parser(sub: Any) -> None:
    """Add ``worker`` to the ``mstar`` subcommands."""
    worker = sub.add_parser(
        "worker",
        help="serve one rank of a runtime on another host, joining it over TCP",
        description=(
            "Join the runtime listening at --conductor (a RemoteLauncher) as --rank, build that "
            "rank's engines and serve its steps until the runtime closes. Start it before or "
            "after the runtime: it asks every second until answered. It builds only a zoo "
            "model (or one of --model) or a builder given with --source, whatever the runtime "
            "names. Exit status: 0 after the runtime's shutdown, 1 on a failure, 2 when "
            "refused or refusing, 3 when the runtime went silent, 4 when the runtime stopped "
            "it, 130 on Ctrl-C or SIGTERM."
        ),
    )
    worker.add_argument(
        "--conductor",
        required=True,
        metavar="tcp://HOST:PORT",
        help="where the runtime's RemoteLauncher listens (default port 5555)",
    )
    worker.add_argument("--rank", required=True, type=_non_negative, help="the rank to serve")
    worker.add_argument(
        "--threads",
        type=_non_negative,
        help="torch threads (default: the runtime's suggestion; give this host's cores)",
    )
    worker.add_argument(
        "--join-timeout",
        type=_positive_float,
        help="give up (exit 2) when no runtime answers within this many seconds (default: wait)",
    )
    worker.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="build only this zoo model when the runtime asks for it (repeatable; default: "
        "any zoo model)",
    )
    worker.add_argument(
        "--source",
        action="append",
        default=[],
        type=_builder,
        metavar="MODULE:FUNCTION",
        help="also build with this model builder when the runtime asks for it (repeatable)",
    )
    add_curve_keys_option(worker, "this worker's sockets (use the runtime's key folder)")
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace, _: list[str]) -> int:
    from mstar_async.worker.join import run_remote_worker
    from mstar_async.worker.sources import AllowedSources

    models = None if args.model is None else frozenset(args.model)
    try:
        return run_remote_worker(
            args.conductor,
            args.rank,
            threads=args.threads or None,
            log_level=args.log_level,
            join_timeout=args.join_timeout,
            curve_keys=load_curve_keys(args.curve_keys),
            allowed=AllowedSources(models, frozenset(args.source)),
        )
    except (MstarError, ValueError) as exc:
        print(f"mstar worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before it joined: nothing to say goodbye to
        return 130
