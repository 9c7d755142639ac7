"""``python -m mstar_async.cli``: the ``mstar`` command without its console script."""

from __future__ import annotations

from mstar_async.command import start

start("mstar")
