"""A worker's tensor store: the large step outputs it keeps for later steps, per request.

Pure bookkeeping (no asyncio, no sockets): the worker puts a step's large output tensors here
and replies with :class:`~mstar_async.transport.TensorRef` handles; later steps (on this worker
or, through a fetch, on another) read them back by key. Everything a request put is dropped when
the request is released. A step still running when its request is released may finish after the
release: the store counts running steps per request and keeps nothing a released request's
step produces, so no entry outlives its request.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from mstar_async.errors import TensorNotHeld
from mstar_async.transport import TensorRef

__all__ = ["KEEP_TENSOR_BYTES", "TensorStore"]

#: Output tensors of at least this many bytes stay on the worker that made them; smaller ones
#: travel back in the reply (a handle and a later fetch cost more than the bytes).
KEEP_TENSOR_BYTES = 64 * 1024


class TensorStore:
    """Tensors kept for later steps, by key and by request.

    ``rank`` and ``generation`` go into every handle, so a handle from before a restart never
    names a tensor of the new worker. ``keep_bytes`` is the size from which output tensors are
    kept (default :data:`KEEP_TENSOR_BYTES`).
    """

    def __init__(self, rank: int, generation: int, *, keep_bytes: int = KEEP_TENSOR_BYTES) -> None:
        self.rank = rank
        self.generation = generation
        self.keep_bytes = keep_bytes
        self._tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[str, list[str]] = {}  # request id -> keys it put
        self._running: dict[str, int] = {}  # request id -> steps in flight here
        self._released: set[str] = set()  # released while a step of theirs still ran
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        return sum(t.nbytes for t in self._tensors.values())

    def stats(self) -> dict[str, int]:
        """``tensors_held``, ``tensor_bytes_held``, ``requests_held`` and ``steps_running``."""
        return {
            "tensors_held": len(self._tensors),
            "tensor_bytes_held": self.nbytes,
            "requests_held": len(self._keys),
            "steps_running": sum(self._running.values()),
        }

    def step_started(self, request_id: str) -> None:
        """A step of ``request_id`` starts here; pair with :meth:`keep` or :meth:`step_failed`."""
        self._running[request_id] = self._running.get(request_id, 0) + 1
        self._released.discard(request_id)

    def step_failed(self, request_id: str) -> None:
        """A step of ``request_id`` ended without outputs."""
        self._step_ended(request_id)

    def keep(self, request_id: str, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """End a step: its outputs with each large top-level tensor replaced by a handle.

        Only the outputs' own values are looked at, not tensors nested in lists or dataclasses
        (those travel as bytes). A step whose request was released meanwhile keeps nothing.
        """
        released = self._step_ended(request_id)
        out = dict(outputs)
        if released:
            return out
        for port, value in outputs.items():
            if isinstance(value, torch.Tensor) and value.nbytes >= self.keep_bytes:
                out[port] = self._put(request_id, value)
        return out

    def hold(self, request_id: str, value: Any) -> Any:
        """``value``, or a handle to it kept here when it is a large tensor (a value a walk
        segment sends another rank, which fetches it from here). Never raises."""
        if isinstance(value, torch.Tensor) and value.nbytes >= self.keep_bytes:
            return self._put(request_id, value)
        return value

    def _put(self, request_id: str, tensor: torch.Tensor) -> TensorRef:
        key = f"{self.generation}.{next(self._ids)}"
        self._tensors[key] = tensor
        self._keys.setdefault(request_id, []).append(key)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRef(self.rank, key, tuple(tensor.shape), dtype)

    def _step_ended(self, request_id: str) -> bool:
        left = self._running.get(request_id, 0) - 1
        if left > 0:
            self._running[request_id] = left
            return request_id in self._released
        self._running.pop(request_id, None)
        if request_id in self._released:
            self._released.discard(request_id)
            return True
        return False

    def get(self, ref: TensorRef) -> torch.Tensor:
        """The tensor behind ``ref`` (the very object kept: no copy).

        Raises:
            TensorNotHeld: the handle is not this worker's, or its request was released.
        """
        tensor = self._tensors.get(ref.key) if ref.rank == self.rank else None
        if tensor is None:
            raise TensorNotHeld(
                f"rank {self.rank} holds no tensor {ref.key!r} (rank {ref.rank}, shape "
                f"{ref.shape}): its request was released or the worker restarted since"
            )
        return tensor

    def release(self, request_id: str) -> None:
        """Drop every tensor ``request_id`` put here; steps of it still running keep nothing.
        Idempotent; never raises."""
        for key in self._keys.pop(request_id, ()):
            del self._tensors[key]
        if request_id in self._running:
            self._released.add(request_id)

    def clear(self) -> None:
        """Drop everything (the worker is stopping). Never raises."""
        self._tensors.clear()
        self._keys.clear()
