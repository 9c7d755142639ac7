"""A Llama GGUF file's tensors under Hugging Face names: as float32, dequantized exactly as
``gguf.quants.dequantize`` does, or, for the block formats the weight-only kernels take
(Q4_0, Q4_1, Q8_0), as the blocks' own codes and scales (``QuantizedWeight``).

Block layouts (32 weights per block, ggml's): Q8_0 is a float16 scale ``d`` then 32 int8 codes,
``w = d * q``; Q4_0 is ``d`` then 16 bytes of 4-bit codes, ``w = d * (q - 8)``; Q4_1 is ``d``, a
float16 minimum ``m``, then 16 bytes of codes, ``w = d * q + m``. A code byte ``j`` holds weight
``j`` in its low nibble and weight ``j + 16`` in its high nibble. Scales and minima widen from
float16 to float32 exactly, so the ``QuantizedWeight`` of a block dequantizes bit for bit as
gguf does. q_proj / k_proj rows (codes and scales alike) are put back in Hugging Face's rotary
order (``llama_layout``).

Only the file's tensor table is parsed (``tensor_table``): ``gguf.GGUFReader`` builds a numpy
view of every metadata value, which for a 49,152-token vocabulary takes seconds; the table
takes milliseconds, and each tensor is then a slice of one read-only memory map.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import dequantize

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.llama_layout import (
    deinterleave_rope_rows,
    hf_name,
    is_rope_projection,
)
from mstar_async.models.quant.weights import QuantizedWeight

__all__ = ["BLOCK_TYPES", "GGUFTensors", "TensorEntry", "decode_blocks", "tensor_table"]

_BLOCK = 32

#: The block formats read as codes and scales: bytes per block of 32 weights.
BLOCK_TYPES = {
    GGMLQuantizationType.Q8_0: 34,
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
}


def decode_blocks(raw: np.ndarray, kind: GGMLQuantizationType, cols: int) -> QuantizedWeight:
    """The ``[rows, cols]`` weight stored as ``raw`` (uint8 ``[rows, bytes per row]``, as
    ``GGUFReader`` gives a block tensor) in block format ``kind``, as codes and scales.

    Raises:
        CheckpointError: ``kind`` is not one of ``BLOCK_TYPES``, or ``raw`` does not hold
            ``cols`` weights per row in that format.
    """
    if kind not in BLOCK_TYPES:
        raise CheckpointError(f"GGUF {kind.name} blocks are not read as codes")
    size = BLOCK_TYPES[kind]
    if cols % _BLOCK or raw.ndim != 2 or raw.shape[1] != cols // _BLOCK * size:
        raise CheckpointError(
            f"a GGUF {kind.name} tensor of {cols} columns needs {cols // _BLOCK * size} bytes "
            f"per row, got an array of shape {raw.shape}"
        )
    rows = raw.shape[0]
    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(rows, cols // _BLOCK, size)

    def half(start: int) -> torch.Tensor:  # the float16 at byte ``start`` of every block
        return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()

    if kind == GGMLQuantizationType.Q8_0:
        codes = blocks[..., 2:].contiguous().view(torch.int8)
        return QuantizedWeight(codes.reshape(rows, cols), half(0), None, 8, _BLOCK)
    packed = blocks[..., size - 16 :]
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int8).reshape(rows, cols)
    if kind == GGMLQuantizationType.Q4_0:
        return QuantizedWeight(nibbles - 8, half(0), None, 4, _BLOCK)
    return QuantizedWeight(nibbles, half(0), half(2), 4, _BLOCK)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a GGUF file: its name, storage type, dimensions fastest-first (GGUF's
    ``ne``), and where its bytes lie in the file."""

    name: str
    kind: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows_and_bytes(self) -> tuple[int, int]:
        """``(rows, bytes per row)``: the data as a uint8 matrix, one row per ``dims[0]``."""
        block, size = GGML_QUANT_SIZES[self.kind]
        return math.prod(self.dims[1:]), self.dims[0] // block * size


# Metadata value types of the GGUF format: fixed sizes, 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str) -> Any:
        return self.take(fmt)[0]

    def string(self) -> str:
        length = self.one("Q")
        self.at += length
        return self.data[self.at - length : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.take("IQ")
            if inner in _SCALAR_BYTES:
                self.at += count * _SCALAR_BYTES[inner]
            else:
                for _ in range(count):
                    self.value(inner)
            return None
        if kind == _UINT32:
            return self.one("I")
        if kind not in _SCALAR_BYTES:
            raise ValueError(f"unknown metadata value type {kind}")
        self.at += _SCALAR_BYTES[kind]
        return None


def tensor_table(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors of the (little-endian, version 2 or 3) GGUF file at ``path``, by GGUF name,
    read from its header without building its metadata. Blocks on the read.

    Raises:
        CheckpointError: the file is missing, is not such a GGUF, or is cut short.
    """
    try:
        with open(path, "rb") as file:
            header = file.read(64 * 2**20)  # metadata and tensor infos come first
            size = file.seek(0, 2)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} as GGUF: {exc}") from exc
    cursor = _Cursor(header)
    try:
        magic, version, tensors, fields = cursor.take("IIQQ")
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"magic {magic:#x}, version {version}")
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(fields):
            key, kind = cursor.string(), cursor.one("I")
            value = cursor.value(kind)
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(tensors):
            name, ndims = cursor.string(), cursor.one("I")
            dims = tuple(int(d) for d in cursor.take(f"{ndims}Q"))
            kind, offset = cursor.take("IQ")
            infos.append((name, GGMLQuantizationType(kind), dims, int(offset)))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a GGUF file this reader takes: {exc}") from exc
    start = -(-cursor.at // alignment) * alignment
    table: dict[str, TensorEntry] = {}
    for name, kind, dims, offset in infos:
        block, bytes_per_block = GGML_QUANT_SIZES[kind]
        nbytes = math.prod(dims) // block * bytes_per_block
        if start + offset + nbytes > size:
            raise CheckpointError(f"{path} is cut short: tensor {name} ends past its end")
        table[name] = TensorEntry(name, kind, dims, start + offset, nbytes)
    return table


class GGUFTensors:
    """The tensors of a Llama GGUF file, by Hugging Face name (a ``TensorSource``).

    ``read`` gives float32 tensors (every type ``gguf`` dequantizes); ``read_quantized`` gives
    Q4_0 / Q4_1 / Q8_0 tensors as ``QuantizedWeight`` and any other as ``read`` does. Reads
    block on the file.
    """

    def __init__(self, path: str | Path, config: Mapping[str, Any]) -> None:
        """Open ``path``; ``config`` (its Hugging Face ``config.json``) gives the head counts
        that q/k rows are reordered by. Blocks on reading the tensor table.

        Raises:
            CheckpointError: the file cannot be read as GGUF, or holds a tensor a plain Llama
                model does not have.
        """
        self.path = Path(path)
        self._entries = {hf_name(e.name): e for e in tensor_table(self.path).values()}
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._heads = {
            "q_proj": int(config["num_attention_heads"]),
            "k_proj": int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's Hugging Face name and torch shape (``[out, in]`` for a matrix)."""
        # GGUF lists dimensions fastest-first (ne[0] = in_features); torch wants them reversed.
        return {name: tuple(reversed(e.dims)) for name, e in self._entries.items()}

    def kind(self, name: str) -> GGMLQuantizationType:
        """The storage type of tensor ``name``. Raises ``KeyError`` for an unknown name."""
        return self._entries[name].kind

    def _raw(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        return self._data[entry.offset : entry.offset + entry.nbytes].reshape(entry.rows_and_bytes)

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each of ``names`` as float32: ``BLOCK_TYPES`` through ``decode_blocks`` (bit
        for bit what ``gguf.quants.dequantize`` gives, faster), other types through
        ``gguf.quants.dequantize``.

        Raises:
            KeyError: a name the file lacks.
            CheckpointError: a tensor's type cannot be dequantized.
        """
        for name in names:
            entry = self._entries[name]
            shape = tuple(reversed(entry.dims))
            if entry.kind in BLOCK_TYPES:
                weight = decode_blocks(self._raw(name), entry.kind, entry.dims[0]).dequantize()
            else:
                try:
                    values = np.array(dequantize(self._raw(name), entry.kind), dtype=np.float32)
                except NotImplementedError as exc:
                    raise CheckpointError(f"GGUF tensor {entry.name}: {exc}") from exc
                weight = torch.from_numpy(values)
            yield name, self._reorder(name, weight.reshape(shape))

    def read_quantized(
        self, names: Sequence[str]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield each of ``names``: a ``BLOCK_TYPES`` matrix as its codes and scales, any other
        tensor as ``read`` yields it.

        Raises:
            KeyError: a name the file lacks.
            CheckpointError: a tensor's type cannot be dequantized.
        """
        for name in names:
            entry = self._entries[name]
            if entry.kind not in BLOCK_TYPES or len(entry.dims) != 2:
                yield from self.read([name])
                continue
            weight = decode_blocks(self._raw(name), entry.kind, entry.dims[0])
            yield name, self._reorder(name, weight)

    def _reorder(self, name: str, weight: Any) -> Any:
        if not is_rope_projection(name):
            return weight
        heads = self._heads["q_proj" if "q_proj" in name else "k_proj"]
        if isinstance(weight, QuantizedWeight):
            return weight.map_rows(lambda rows: deinterleave_rope_rows(rows, heads))
        return deinterleave_rope_rows(weight, heads)
