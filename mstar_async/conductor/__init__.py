"""The conductor: per-request state, request programs, and where their walks run."""

from __future__ import annotations

from mstar_async.conductor.conductor import Conductor, RequestStream
from mstar_async.conductor.executor import StepExecutor
from mstar_async.conductor.metrics import RequestMetrics
from mstar_async.conductor.request import RequestContext, WalkResult
from mstar_async.conductor.walk_stream import (
    WalkControl,
    WalkEvent,
    WalkHost,
    WalkStream,
)

__all__ = [
    "Conductor",
    "RequestContext",
    "RequestMetrics",
    "RequestStream",
    "StepExecutor",
    "WalkControl",
    "WalkEvent",
    "WalkHost",
    "WalkResult",
    "WalkStream",
]
