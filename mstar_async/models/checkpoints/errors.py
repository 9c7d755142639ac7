"""The one error this subpackage raises on purpose."""

from __future__ import annotations

from mstar_async.errors import MstarError


class CheckpointError(MstarError):
    """A checkpoint folder or GGUF file is missing, incomplete, or in a layout we cannot read.

    The message names the file involved and what should be there.
    """
