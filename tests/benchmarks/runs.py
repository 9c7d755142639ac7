"""Running ``mstar bench`` as a user types it, and the options of each benchmark's smallest
``--quick --json`` run (``conftest.py`` runs each once per session)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from typing import Any

from mstar_async.cli import main

#: ``mstar bench decode`` on the tiny checkpoint: every sequential transformers request of N
#: = 1 and 3 timed, 3 of the 32 at N = 32 (so extrapolation is covered), both dtypes.
# 1 and 32 are the concurrencies the aims name; transformers is timed in full at 1 and
# extrapolated at 32.
DECODE_CONCURRENCY = (1, 32)
DECODE_NEW_TOKENS = 5
DECODE_PROMPT_TOKENS = 12
DECODE_REPEAT = 2
DECODE_TRANSFORMERS_REQUESTS = 3

#: ``mstar bench overhead``: these systems at N = 1 and 2, this many iterations per request.
OVERHEAD_SYSTEMS = ("in-process", "one-worker")
OVERHEAD_CONCURRENCY = (1, 2)
OVERHEAD_ITERATIONS = 5


@dataclass(frozen=True)
class BenchRun:
    """One ``mstar bench`` run: its report (the whole of stdout, parsed) and its progress
    (stderr)."""

    report: dict[str, Any]
    progress: str


def run_bench(*argv: str) -> BenchRun:
    """Run ``mstar bench *argv`` in this process; it must exit 0 and print one JSON object."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", *argv])
    assert code == 0, err.getvalue()
    return BenchRun(json.loads(out.getvalue()), err.getvalue())
