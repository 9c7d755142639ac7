"""What keeps a worker process from outliving its parent, whatever way the parent ends.

Three layers, because each covers a case the others miss: the kernel's parent-death signal
(Linux; immediate, even after ``kill -9`` of the parent), a watchdog that polls the parent's pid
(any POSIX system; within a poll period), and the ``Shutdown`` message a closing runtime sends
(clean exit, engines released). Ctrl-C in a terminal reaches the whole process group: workers
ignore SIGINT and let the parent, which owns the shutdown, stop them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import anyio

#: How often the watchdog checks that the parent is alive.
PARENT_POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel to send SIGTERM when the parent dies (Linux only).

    Returns whether it was set. Never raises.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def ignore_interrupts() -> None:
    """Leave Ctrl-C to the parent: it shuts the workers down in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def watch_parent(parent_pid: int) -> None:
    """Return as soon as the parent process is gone (this process got re-parented).

    Cancel-safe: it only sleeps and reads the parent pid.
    """
    # Polling is the portable way: no event fires when a parent dies.
    while os.getppid() == parent_pid:  # noqa: ASYNC110
        await anyio.sleep(PARENT_POLL_SECONDS)
