"""Reading a local Hugging Face checkpoint folder (config, safetensors weights, tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.tokenizer import ChatTokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """A checkpoint read into memory.

    ``config`` is config.json as parsed; ``state_dict`` maps the upstream parameter names
    (``model.layers.0.self_attn.q_proj.weight``, ...) to tensors; ``path`` is the folder.
    """

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    path: Path


def _read_object(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: put the model's {what} there")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """The safetensors files of ``folder``, each with the tensor names to read from it.

    ``None`` means "every tensor in the file" (the single-file layout). Raises
    ``CheckpointError`` naming the file when the weights, the index, or a shard are missing.
    """
    single = folder / WEIGHTS_FILE
    index_path = folder / WEIGHTS_INDEX_FILE
    if single.is_file():
        return {single: None}
    if not index_path.is_file():
        hint = ""
        if (folder / "pytorch_model.bin").exists():
            hint = " (pytorch_model.bin was found, but only safetensors weights are read)"
        raise CheckpointError(
            f"{single} is missing{hint}: put the weights there as safetensors, or shard them as "
            f"model-0000X-of-0000N.safetensors with a {WEIGHTS_INDEX_FILE} mapping names to shards"
        )
    index = _read_object(index_path, "safetensors shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index_path} has no "weight_map" of tensor name -> shard file')
    shards: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(folder / str(shard), []).append(str(name))
    for shard_path in shards:
        if not shard_path.is_file():
            raise CheckpointError(
                f"{shard_path} is missing: {index_path.name} lists it as a weight shard"
            )
    return {shard_path: names for shard_path, names in shards.items()}


#: Bytes read through one mapping of a weight file before it is mapped afresh. The pages read
#: through a mapping count in the process's RSS until it is unmapped (the page cache keeps them
#: either way), so a rank reading from multi-GB shards holds about this much beside its weights.
REMAP_BYTES = 128 * 2**20


class SafetensorsFolder:
    """The safetensors weights of a checkpoint folder as a ``TensorSource``: names and shapes
    from the files' headers when opened, tensors read one at a time with ``safe_open``, file by
    file, so only the tensors asked for are read, and at most ``REMAP_BYTES`` of one file (or one
    larger tensor) are mapped in at a time.

    Raises (constructor):
        CheckpointError: the weights, the index or a shard is missing or unreadable, or a shard
            lacks a tensor the index gives it.
    """

    def __init__(self, folder: str | Path) -> None:
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._files: dict[Path, list[str]] = {}
        for path, listed in weight_files(Path(folder)).items():
            with _open(path) as f:
                names = list(f.keys()) if listed is None else listed
                for name in names:
                    try:
                        self._shapes[name] = tuple(f.get_slice(name).get_shape())
                    except Exception as exc:  # safetensors raises its own error types
                        raise CheckpointError(f"{path} does not hold {name}: {exc}") from exc
            self._files[path] = names

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape (from the headers; no tensor data is read)."""
        return dict(self._shapes)

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each of ``names`` with its tensor, file by file (a tensor is a view of the
        mapped file, valid until the next is yielded: copy it).

        Blocks on disk reads (run it in a thread); closing the iterator early closes the file.

        Raises:
            KeyError: a name no file holds.
            CheckpointError: a file cannot be read.
        """
        wanted = set(names)
        unknown = wanted - self._shapes.keys()
        if unknown:
            raise KeyError(f"no weight file holds {sorted(unknown)[:8]}")
        for path, held in self._files.items():
            mine = iter([name for name in held if name in wanted])
            name = next(mine, None)
            while name is not None:
                with _open(path) as f:
                    mapped = 0
                    while name is not None and mapped < REMAP_BYTES:
                        try:
                            tensor = f.get_tensor(name)
                        except Exception as exc:  # safetensors raises its own error types
                            raise CheckpointError(f"cannot read {name} from {path}: {exc}") from exc
                        mapped += tensor.numel() * tensor.element_size()
                        yield name, tensor
                        del tensor
                        name = next(mine, None)


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise CheckpointError(f"cannot read weights from {path}: {exc}") from exc


def load_state_dict(
    folder: str | Path, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read every tensor of the safetensors checkpoint in ``folder`` into memory.

    Floating tensors are cast to ``dtype`` when given; others keep theirs. A model that loads
    only what it needs streams from a ``SafetensorsFolder`` instead.

    Raises:
        CheckpointError: a weight file is missing or unreadable (the message names it).
    """
    source = SafetensorsFolder(folder)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in source.read(list(source.shapes())):
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        state[name] = tensor.to(cast, copy=True)
    return state


def read_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of the checkpoint folder ``folder``, parsed (no weights are read).

    Raises:
        CheckpointError: the file is missing, unreadable, or not a JSON object.
    """
    return _read_object(
        Path(folder) / CONFIG_FILE, "configuration (config.json from save_pretrained)"
    )


def load_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None) -> Checkpoint:
    """Load the Hugging Face checkpoint folder at ``path``.

    Reads ``config.json``, the weights (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), and the tokenizer (``tokenizer.json`` plus optional
    ``tokenizer_config.json`` / ``generation_config.json``). ``dtype`` casts floating tensors;
    by default they keep the stored dtype. Raises ``CheckpointError`` naming the missing or
    broken file and what belongs there.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder: pass a Hugging Face checkpoint folder")
    config = read_config(folder)
    tokenizer = ChatTokenizer.from_folder(folder)
    state_dict = load_state_dict(folder, dtype)
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, path=folder)
