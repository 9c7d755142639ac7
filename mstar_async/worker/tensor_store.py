"""A worker's tensor store: the large tensors that leave its walks for another process, kept
here per request.

Pure bookkeeping (no asyncio, no sockets): a value a walk leaves for later walks of its request,
or sends another rank's segment over a plain edge, stays here when it is a large tensor, and a
:class:`~mstar_async.transport.TensorRef` handle travels instead; the worker that needs it (this
one, or another through a fetch) reads it back by key. Everything a request put is dropped when
the request is released (the worker stops the request's walks first, so none puts anything
after).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from mstar_async.errors import TensorNotHeld
from mstar_async.transport import TensorRef

__all__ = ["KEEP_TENSOR_BYTES", "TensorStore"]

#: Tensors of at least this many bytes stay on the worker that made them; smaller ones travel
#: as bytes (a handle and a later fetch cost more than the bytes).
KEEP_TENSOR_BYTES = 64 * 1024


class TensorStore:
    """Tensors kept for other processes, by key and by request.

    ``rank`` and ``generation`` go into every handle, so a handle from before a restart never
    names a tensor of the new worker. ``keep_bytes`` is the size from which tensors are kept
    (default :data:`KEEP_TENSOR_BYTES`).
    """

    def __init__(self, rank: int, generation: int, *, keep_bytes: int = KEEP_TENSOR_BYTES) -> None:
        self.rank = rank
        self.generation = generation
        self.keep_bytes = keep_bytes
        self._tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[str, list[str]] = {}  # request id -> keys it put
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        return sum(t.nbytes for t in self._tensors.values())

    def stats(self) -> dict[str, int]:
        """``tensors_held``, ``tensor_bytes_held`` and ``requests_held``."""
        return {
            "tensors_held": len(self._tensors),
            "tensor_bytes_held": self.nbytes,
            "requests_held": len(self._keys),
        }

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
        """Drop every tensor ``request_id`` put here. Idempotent; never raises."""
        for key in self._keys.pop(request_id, ()):
            del self._tensors[key]

    def clear(self) -> None:
        """Drop everything (the worker is stopping). Never raises."""
        self._tensors.clear()
        self._keys.clear()
