"""Messages between the conductor and workers, and the ways they travel.

In one process a ``StepCall`` is handed over as a Python object, tensors and all; across
processes the same message travels as a small typed header plus raw tensor frames.
"""

from __future__ import annotations

from mstar_async.transport.messages import StepCall

__all__ = ["StepCall"]
