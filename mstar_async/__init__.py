"""mstar_async: an asyncio-native serving runtime for composite multimodal models.

A model is a graph of components plus named walks over it; a request is a program over walks.
See ``docs/concepts.md`` for the model and ``DESIGN``-level layering in ``docs/architecture.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"
