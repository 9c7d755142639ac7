"""The ``mstar`` command."""

from __future__ import annotations

from mstar_async.cli.main import main

__all__ = ["main"]
