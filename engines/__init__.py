"""Engines: components that run batched steps (stateless, or with a paged KV cache)."""

from __future__ import annotations

from mstar_async.engines.base import WAIT, Engine, MovableState, Step, StepResult, Wait
from mstar_async.engines.stateless import StatelessEngine

__all__ = ["WAIT", "Engine", "MovableState", "StatelessEngine", "Step", "StepResult", "Wait"]
