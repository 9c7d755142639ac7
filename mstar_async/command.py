"""How our programs start and end: the ``mstar`` console script and the worker processes
(``python -m mstar_async.command worker``). Each imports its module with the garbage
collector off, runs the module's ``main`` and exits with its status."""

from __future__ import annotations

import gc
import importlib
import sys

__all__ = ["PROGRAMS", "run", "start"]

#: The programs by name: the module whose ``main() -> int`` each runs.
PROGRAMS = {"mstar": "mstar_async.cli.main", "worker": "mstar_async.worker.main"}


def start(program: str) -> None:
    """Run ``program`` (a key of ``PROGRAMS``) and end the process with its status.

    Raises:
        SystemExit: always, with ``main``'s status (1, naming the programs, for an unknown
            name).
    """
    if program not in PROGRAMS:
        sys.exit(f"no program {program!r}; programs: {', '.join(sorted(PROGRAMS))}")
    # Importing a program imports torch and the package: objects that live as long as the
    # process. Collected while they arrive they cost 0.25 s of every start on a 2-core machine
    # (some 400 collections, 3 of them full); imported with the collector off and then frozen
    # (moved where no collection looks), nothing, and later full collections skip them too.
    gc.disable()
    module = importlib.import_module(PROGRAMS[program])
    gc.freeze()
    gc.enable()
    status = module.main()
    # Ending the interpreter collects every object again (0.5 s with torch's); frozen, they
    # are skipped. The process ends anyway, and the standard streams are still flushed.
    gc.freeze()
    sys.exit(status)


def run() -> None:
    """The ``mstar`` console script (see ``start``).

    Raises:
        SystemExit: always.
    """
    start("mstar")


if __name__ == "__main__":
    start(sys.argv.pop(1) if len(sys.argv) > 1 else "")
