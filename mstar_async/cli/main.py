"""``mstar``: run models, list them, benchmark them, serve a rank for another host, make the
keys that secure it.

The CLI owns its event loop, so it uses uvloop when present."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mstar_async.cli.bench import add_bench_parser
from mstar_async.cli.keys import add_keys_parser
from mstar_async.cli.run import add_run_parser
from mstar_async.cli.serve import add_serve_parser
from mstar_async.cli.worker import add_worker_parser
from mstar_async.logs import configure_logging
from mstar_async.models import list_models


def _models(_: argparse.Namespace, __: list[str]) -> int:
    for entry in list_models():
        print(f"{entry.name:16s} {entry.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mstar`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="mstar",
        description="Serve composite multimodal models: a graph of components plus walks.",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="DEBUG, INFO, WARNING (default), ERROR",
    )
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of text")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models = sub.add_parser("models", help="list the models in the zoo")
    models.set_defaults(handler=_models)
    add_run_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_worker_parser(sub)
    add_keys_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mstar``; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    configure_logging(args.log_level, json=args.log_json)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    status: int = args.handler(args, extra)
    return status
