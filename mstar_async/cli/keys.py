"""``mstar keys generate DIR``: the CURVE keys that authenticate and encrypt worker traffic over
TCP, and the ``--curve-keys`` option that the runtime's and the worker's commands share (see
docs/processes.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mstar_async.errors import MstarError
from mstar_async.transport import CurveKeys, generate_curve_keys

#: The environment variable ``--curve-keys`` defaults to.
CURVE_KEYS_VARIABLE = "MSTAR_CURVE_KEYS"


def add_keys_parser(sub: Any) -> None:
    """Add ``keys`` (``keys generate DIR``) to the ``mstar`` subcommands."""
    keys = sub.add_parser(
        "keys",
        help="make the CURVE keys that secure worker traffic over TCP",
        description="Key folders for --curve-keys on `mstar run --listen` and `mstar worker`.",
    )
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    generate = actions.add_parser(
        "generate",
        help="write a runtime and a worker keypair into DIR",
        description=(
            "Write runtime.key, runtime.key_secret, worker.key and worker.key_secret into DIR "
            "(made 0700 if missing; secret files 0600; existing keys are never overwritten)."
        ),
    )
    generate.add_argument("folder", metavar="DIR", help="the key folder")
    generate.set_defaults(handler=_generate)


def add_curve_keys_option(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--curve-keys DIR`` (default: ``$MSTAR_CURVE_KEYS``) to ``parser``; ``what`` says
    what the keys secure there."""
    parser.add_argument(
        "--curve-keys",
        default=os.environ.get(CURVE_KEYS_VARIABLE),
        metavar="DIR",
        help=f"CURVE key folder from `mstar keys generate` that secures {what} (default: the "
        f"{CURVE_KEYS_VARIABLE} environment variable; none: loopback addresses only)",
    )


def load_curve_keys(folder: str | None) -> CurveKeys | None:
    """The keys in ``folder``, or None without one.

    Raises:
        MstarError: the folder cannot be used (the message says why).
    """
    return None if not folder else CurveKeys.load(folder)


def _generate(args: argparse.Namespace, _: list[str]) -> int:
    try:
        keys = generate_curve_keys(args.folder)
    except MstarError as exc:
        print(f"mstar keys: {exc}", file=sys.stderr)
        return 2
    where = keys.folder
    print(f"wrote {where}/runtime.key(_secret) and {where}/worker.key(_secret)")
    print(f"  runtime's host: all four files (mstar run ... --curve-keys {where})")
    print(
        "  worker hosts: runtime.key, worker.key and worker.key_secret, copied privately "
        f"(mstar worker ... --curve-keys {where})"
    )
    return 0
