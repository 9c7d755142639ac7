"""What one rank's batching loop runs and holds now, as plain data.

One function builds it for both places that ask: a worker answering the pool's ``Ping``, and
a runtime reading its own loop in this process (``Runtime.stats``), so every rank reports the
same fields the same way.
"""

from __future__ import annotations

from typing import Any

from mstar_async.worker.walk_loop import WalkLoop


def loop_report(batching: WalkLoop) -> dict[str, Any]:
    """The loop's counters: ``walks`` running, steps ``waiting`` (queued or parked), ``kv``
    (``{engine: [blocks used, blocks total]}`` for engines with a paged cache), ``kv_blocks``
    (used, summed), ``kv_handles`` and ``kv_kept_blocks`` (KV kept beyond requests),
    ``forwards``, ``steps``, ``batch_sizes`` (``{steps: forwards}``) and ``stalled_ms``.
    Never raises; cheap enough for every scrape."""
    stats = batching.stats
    scheduler = batching.scheduler
    return {
        "walks": batching.walks_running,
        "waiting": scheduler.queued + len(scheduler.parked),
        "kv": _kv_blocks(batching),
        "kv_blocks": batching.kv_blocks_in_use,
        "kv_handles": batching.kv_handles,
        "kv_kept_blocks": batching.kv_kept_blocks,
        "forwards": stats.forwards,
        "steps": stats.steps,
        # One C-level copy: the forward thread writes the counter.
        "batch_sizes": dict(stats.batch_sizes),
        "stalled_ms": int(batching.stalled_s * 1000),
    }


def _kv_blocks(batching: WalkLoop) -> dict[str, list[int]]:
    found = {}
    for name, engine in batching.engines.items():
        allocator = getattr(engine, "allocator", None)
        if allocator is not None:
            found[name] = [int(allocator.num_used_blocks), int(allocator.num_blocks)]
    return found
