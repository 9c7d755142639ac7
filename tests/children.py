"""Child processes that tests start: signals the test relies on, and an end however it ends.

A shell's background job starts with SIGINT (and SIGQUIT) ignored, and a child inherits that:
a test that interrupts its child with Ctrl-C must put SIGINT back to its default in the child,
or the signal never arrives when the suite runs in the background. ``spawn`` does, and
``running`` ends the child (SIGINT, then SIGKILL) however the test ends, so a failure cannot
leave a process behind to fail a later test.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def _default_signals() -> None:
    # Runs in the child between fork and exec.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def spawn(command: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **options)`` with SIGINT and SIGQUIT at their defaults in
    the child, whatever this process ignores."""
    return subprocess.Popen(list(command), preexec_fn=_default_signals, **options)


def stop(process: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """End ``process`` if it still runs: Ctrl-C, then SIGKILL after ``grace`` seconds; reap
    it and close its pipes. Never raises."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
    try:
        process.communicate(timeout=grace)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        process.kill()
        process.wait()


@contextmanager
def running(
    command: Sequence[str], *, grace: float = 30.0, **options: Any
) -> Iterator[subprocess.Popen[Any]]:
    """A child started by ``spawn`` for the block, ended by ``stop`` when the block ends."""
    process = spawn(command, **options)
    try:
        yield process
    finally:
        stop(process, grace)
