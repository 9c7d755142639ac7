"""Writing a folder so that readers only ever see it complete: build beside it, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """Yield a new empty folder beside ``target`` (same filesystem, so renames are atomic).

    Whatever is left of it when the block exits — everything, if the block raised or never
    published it — is deleted.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    )
    # mkdtemp makes the folder owner-only; the published cache should be readable like any other.
    staging.chmod(0o755)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path, *, replace: bool) -> bool:
    """Rename the finished folder ``staging`` to ``target``; return whether it was published.

    If ``target`` exists (e.g. another process got there first) it is kept and ``False`` is
    returned, unless ``replace`` is true: then the old folder is moved aside, the new one
    renamed in, and the old one deleted, so ``target`` is never half-written.
    """
    try:
        os.rename(staging, target)
        return True
    except OSError:
        if not target.exists():
            raise
    if not replace:
        return False
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    previous = old / "previous"
    os.rename(target, previous)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(previous, target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return True
