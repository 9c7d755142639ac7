"""The ``mstar`` program as its console script starts it: the command imported with the
garbage collector off, run, and the process ended with its status."""

from __future__ import annotations

import gc
import sys


def run() -> None:
    """Import ``mstar_async.cli``, run its ``main`` on the process's arguments, exit.

    Raises:
        SystemExit: always, with ``main``'s status.
    """
    # Importing the command imports torch and the package: objects that live as long as the
    # process. Collected while they arrive they cost 0.25 s of every start on a 2-core machine
    # (some 400 collections, 3 of them full); imported with the collector off and then frozen
    # (moved where no collection looks), nothing, and later full collections skip them too.
    gc.disable()
    from mstar_async.cli.main import main

    gc.freeze()
    gc.enable()
    status = main()
    # Ending the interpreter collects every object again (0.5 s with torch's); frozen, they
    # are skipped. The process ends anyway, and the standard streams are still flushed.
    gc.freeze()
    sys.exit(status)
