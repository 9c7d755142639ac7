"""The reactive core: bounded channels and streaming edges between components.

* ``open_channel(max_buffer)``: a bounded, closable, clonable channel of any items, with
  anyio/trio memory-channel semantics (``ChannelSender`` / ``ChannelReceiver``).
* ``open_edge(policy, max_buffer)``: a streaming edge that cuts pushed items into chunks with a
  ``mstar_async.policies.ChunkPolicy`` and delivers them through a bounded channel, with
  backpressure and cancel-safe delivery (``EdgeSender`` / ``EdgeReceiver``).

Errors are anyio's stream exceptions (``EndOfStream``, ``BrokenResourceError``,
``ClosedResourceError``, ``WouldBlock``), ``ValueError`` for bad arguments, and
``mstar_async.errors.ChannelError`` for contract misuse. Layering: this package imports only
anyio, the standard library, ``mstar_async.errors`` and (for types) ``mstar_async.policies``.
"""

from __future__ import annotations

from .channel import ChannelReceiver, ChannelSender, open_channel
from .edge import EdgeReceiver, EdgeSender, open_edge
from .statistics import ChannelStatistics, EdgeStatistics

__all__ = [
    "ChannelReceiver",
    "ChannelSender",
    "ChannelStatistics",
    "EdgeReceiver",
    "EdgeSender",
    "EdgeStatistics",
    "open_channel",
    "open_edge",
]
