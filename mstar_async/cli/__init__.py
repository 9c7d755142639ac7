"""The ``mstar`` command."""

from __future__ import annotations

from mstar_async.cli.main import entry, main

__all__ = ["entry", "main"]
