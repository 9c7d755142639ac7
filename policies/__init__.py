"""Chunk policies: how a streaming edge cuts one request's item stream into chunks.

A policy is a small stateful operator, one per request per edge: ``push(items)`` returns the
chunks that became ready, ``close()`` the tail, ending with the stream's one ``final`` chunk.
Items are a list or a tensor whose dim 0 is the item axis. Each ``Chunk`` says where it sits in
the stream (``start``), how many of its leading items were delivered before (``context``) and
how many trailing items come only to be looked at (``lookahead``). Pure, synchronous; no
asyncio here.
"""

from __future__ import annotations

from .chunk import Chunk
from .fixed import FixedChunkPolicy
from .left_context import LeftContextChunkPolicy
from .policy import ChunkPolicy
from .sliding_window import SlidingWindowChunkPolicy

__all__ = [
    "Chunk",
    "ChunkPolicy",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
]
