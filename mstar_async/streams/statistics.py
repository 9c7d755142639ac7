"""Snapshots of a channel's or a streaming edge's state, for metrics, tests and debugging."""

from __future__ import annotations

from dataclasses import dataclass


# Frozen + slots: a snapshot is a value (safe to keep, compare and log) and is cheap to build;
# it is taken on demand, never on the send/receive hot path.
@dataclass(frozen=True, slots=True)
class ChannelStatistics:
    """A point-in-time snapshot of one channel, the same whichever end (or clone) it came from.

    ``buffered``: items in the buffer now. ``peak``: the most items the buffer ever held (items
    handed straight from a sender to a waiting receiver never count). ``max_buffer``: the bound.
    ``open_senders`` / ``open_receivers``: unclosed ends, clones included. ``waiting_senders`` /
    ``waiting_receivers``: tasks blocked in ``send()`` / ``receive()``. Pure data; never raises.
    """

    buffered: int
    peak: int
    max_buffer: int
    open_senders: int
    open_receivers: int
    waiting_senders: int
    waiting_receivers: int


# A subclass rather than a wrapper, so code that reads channel statistics reads edge ones as is.
@dataclass(frozen=True, slots=True)
class EdgeStatistics(ChannelStatistics):
    """A channel snapshot of a streaming edge's chunk channel, plus the sender's ``pending``.

    ``pending``: chunks the policy produced that are not in the channel yet (left by a cancelled
    ``send``, or produced by the ``send`` in progress). Counts are in chunks, not items. Pure
    data; never raises.
    """

    pending: int
