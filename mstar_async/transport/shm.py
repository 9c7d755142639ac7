"""Shared-memory segments for large tensors between processes on one host.

A segment is a file in ``/dev/shm`` (tmpfs: its pages are memory, never disk) named
``mstar-<pid>-<token>-<n>``, the pid and a random per-pool token of the process that made
it. Its first :data:`HEAD_BYTES` hold a busy flag, the tensor's bytes follow.

Who owns what. The sending side's :class:`SegmentPool` creates, reuses and unlinks its
segments; receivers only map them. Sending a tensor copies its bytes once into a free
segment of the pool and sets the busy flag; the message carries the segment's name. The
receiver maps the segment (:func:`map_array`) and gets an array over it with no copy; when
the last tensor over that array is freed, a finalizer clears the busy flag and unmaps, and
the sender's pool may write the segment again. So a 64 MB tensor costs one memory copy on
the sending side and page-table work on the receiving side: no kernel socket copy, and no
fresh pages per message (a new tmpfs file must allocate and zero every page, which on a
busy machine costs more than the copy itself).

Leaks. Nothing outlives its pool in ``/dev/shm``: :meth:`SegmentPool.close` (run by
``ZmqHub.close``) unlinks every segment of the pool, including ones whose message was never
read (a mapping a receiver still holds stays valid after the unlink). A send that fails or
is cancelled hands its segments back at once (:meth:`ShmBatch.cancel`). Segments of a
process that died without closing its pool are removed by :func:`sweep_orphans`, which a new
pool runs once (it assumes one pid namespace, as processes that share IPC sockets have).

Memory. A segment's capacity is the tensor's size rounded up to a power of two (tmpfs backs
only the pages written, so the slack costs nothing). A pool keeps at most
``_FREE_PER_CLASS`` (2) free segments per capacity, with their pages, beyond the one it hands
out; more are unlinked as they are found free.

A message's shared-memory tensors may be decoded once: the first receiver to release its
tensor frees the segment for reuse.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mstar_async.logs import get_logger
from mstar_async.transport.errors import TransportError

__all__ = [
    "HEAD_BYTES",
    "PREFIX",
    "SHM_DIR",
    "SHM_TENSOR_BYTES",
    "SegmentPool",
    "ShmBatch",
    "available",
    "map_array",
    "segment_names",
    "sweep_orphans",
]

#: Where segments live: tmpfs, so a segment's pages are memory.
SHM_DIR = "/dev/shm"

#: Every segment's name starts with this, then the creating process's pid.
PREFIX = "mstar-"

#: Tensors of at least this many bytes travel through shared memory on links that use it.
#: Below it a segment's fixed cost (open, map, finalizer: a few hundred microseconds on a busy
#: machine) outweighs the kernel's two socket copies; the two break even near 2 MiB.
SHM_TENSOR_BYTES = 2 << 20

#: Bytes before a segment's data: the busy flag (byte 0), padded so the data is 64-byte aligned.
HEAD_BYTES = 64

#: Free segments a pool keeps per size class; more are unlinked as they come free.
_FREE_PER_CLASS = 2

_NAME = re.compile(r"mstar-(\d+)-[0-9a-f]+-\d+")
_log = get_logger(__name__)


def available() -> bool:
    """Whether this host has a ``/dev/shm`` to put segments in. Never raises."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def segment_names() -> list[str]:
    """The names of every ``mstar-`` segment in ``/dev/shm`` now (any process). Never raises."""
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX))
    except OSError:
        return []


def _size_class(nbytes: int) -> int:
    # Capacities are powers of two: a segment serves any tensor up to its size, and tmpfs
    # allocates only pages that are written, so the slack costs no memory.
    return 1 << max(nbytes - 1, 1).bit_length()


@dataclass(eq=False)
class _Segment:
    name: str
    capacity: int
    mm: mmap.mmap

    @property
    def busy(self) -> bool:
        return self.mm[0] != 0

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        self.mm.close()


@dataclass(eq=False)
class ShmBatch:
    """The segments one outgoing message took from a pool; :meth:`cancel` gives them back
    when the message is not sent. Made by :meth:`SegmentPool.batch`."""

    pool: SegmentPool
    taken: list[_Segment] = field(default_factory=list)

    def write(self, data: memoryview) -> str:
        """Copy ``data`` (bytes, C-contiguous) into a free segment; return its name.

        Raises:
            TransportError: the pool is closed, or the segment cannot be made (``/dev/shm``
                full or missing).
        """
        segment = self.pool._acquire(data.nbytes)
        self.taken.append(segment)
        view = memoryview(segment.mm)
        try:
            view[HEAD_BYTES : HEAD_BYTES + data.nbytes] = data.cast("B")
        finally:
            view.release()
        return segment.name

    def cancel(self) -> None:
        """Mark the segments free again: the message that named them was not sent. Never
        raises; idempotent."""
        for segment in self.taken:
            if not segment.mm.closed:
                segment.mm[0] = 0
        self.taken.clear()


class SegmentPool:
    """The segments one sending side writes tensors into, reused once receivers free them.

    Use from one thread (an event loop's). :meth:`close` unlinks them all.
    """

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)
        self._numbers = itertools.count()
        self._classes: dict[int, list[_Segment]] = {}
        self._closed = False
        sweep_orphans()

    @property
    def segments(self) -> int:
        """How many segments this pool holds (busy or free)."""
        return sum(len(group) for group in self._classes.values())

    def batch(self) -> ShmBatch:
        """A new :class:`ShmBatch` for one outgoing message. Never raises."""
        return ShmBatch(self)

    def close(self) -> None:
        """Unlink every segment of the pool. Mappings receivers hold stay valid; messages
        not read yet can no longer be decoded. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for group in self._classes.values():
            for segment in group:
                segment.unlink()
        self._classes.clear()

    def _acquire(self, nbytes: int) -> _Segment:
        if self._closed:
            raise TransportError("shared-memory pool is closed")
        capacity = _size_class(nbytes)
        group = self._classes.setdefault(capacity, [])
        found: _Segment | None = None
        free = 0
        for segment in list(group):
            if segment.busy:
                continue
            if found is None:
                found = segment
            elif free < _FREE_PER_CLASS:
                free += 1
            else:
                group.remove(segment)
                segment.unlink()
        if found is None:
            found = self._create(capacity)
            group.append(found)
        found.mm[0] = 1
        return found

    def _create(self, capacity: int) -> _Segment:
        name = f"{PREFIX}{os.getpid()}-{self._token}-{next(self._numbers)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TransportError(
                f"cannot create shared-memory segment {path}: {exc}; free space in {SHM_DIR} "
                "or open the link with shared_memory=False"
            ) from exc
        try:
            os.ftruncate(fd, HEAD_BYTES + capacity)
            mm = mmap.mmap(fd, HEAD_BYTES + capacity)
        except OSError as exc:
            os.unlink(path)
            raise TransportError(f"cannot size shared-memory segment {path}: {exc}") from exc
        finally:
            os.close(fd)
        return _Segment(name, capacity, mm)


def _release(mm: mmap.mmap) -> None:
    # The array is being freed with the last tensor over it: the segment is free for its
    # sender again. The mapping goes when the array's buffer (and with it ``mm``) is freed,
    # just after this; closing it here would fail, the array still exports it.
    if not mm.closed:
        mm[0] = 0


def map_array(name: str, dtype: np.dtype[Any], shape: Sequence[int]) -> np.ndarray[Any, Any]:
    """A writable array of ``dtype`` and ``shape`` over segment ``name``'s data, no copy.

    The array keeps the mapping alive; when it is freed (with every tensor made from it),
    the segment's busy flag is cleared so that its sender may reuse it, and it is unmapped.
    Synchronous; a few system calls.

    Raises:
        TransportError: ``name`` is not a segment name, the segment is gone (its sender
            closed or died before the message was read), too small for ``shape``, or not
            marked busy (decoded twice, or not a message's segment).
    """
    if _NAME.fullmatch(name) is None:
        raise TransportError(f"message names {name!r}, which is not a shared-memory segment")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise TransportError(
            f"shared-memory segment {name} is gone: its sender closed or died before this "
            "message was read"
        ) from None
    except OSError as exc:
        raise TransportError(f"cannot open shared-memory segment {name}: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < HEAD_BYTES + nbytes:
            raise TransportError(
                f"shared-memory segment {name} holds {size - HEAD_BYTES} bytes, but the "
                f"message needs {nbytes}"
            )
        # Populate: one call maps every page now instead of one fault per page on first use.
        mm = mmap.mmap(fd, HEAD_BYTES + nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    if mm[0] == 0:
        mm.close()
        raise TransportError(
            f"shared-memory segment {name} is not held for a message (decoded twice?)"
        )
    array: np.ndarray[Any, Any] = np.ndarray(
        tuple(shape), dtype, memoryview(mm)[HEAD_BYTES : HEAD_BYTES + nbytes]
    )
    weakref.finalize(array, _release, mm)
    return array


def sweep_orphans() -> int:
    """Unlink the segments of processes that no longer run; return how many. Never raises."""
    removed = 0
    for name in segment_names():
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            continue
    if removed:
        _log.info("shm.swept_orphans", segments=removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
