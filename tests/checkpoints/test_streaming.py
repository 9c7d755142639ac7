"""Streaming a checkpoint into a module built on the meta device: what is read, where it lands,
and what is refused before anything is read."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mstar_async.models.checkpoints import CheckpointError, SafetensorsFolder, hf_folder
from mstar_async.models.checkpoints.streaming import (
    Piece,
    StateDictSource,
    empty_module,
    load_weights,
)

pytestmark = pytest.mark.timeout(30)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.stack = nn.Parameter(torch.zeros(2, 4, 3))  # [experts, gate|up, hidden]


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(5, 3, generator=gen)}
    for e in range(2):
        state[f"e.{e}.gate"] = torch.randn(2, 3, generator=gen)
        state[f"e.{e}.up"] = torch.randn(2, 3, generator=gen)
    return state


def _layout(name: str, shape: tuple[int, ...]) -> list[Piece]:
    if name != "stack":
        return [Piece(name)]
    return [
        piece
        for e in range(shape[0])
        for piece in (Piece(f"e.{e}.gate", (e, slice(0, 2))), Piece(f"e.{e}.up", (e, slice(2, 4))))
    ]


class Counting(StateDictSource):
    """Remembers the names it yields."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.names: list[str] = []

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().read(names):
            self.names.append(name)
            yield name, tensor


def _write_shards(folder: Path, state: dict[str, torch.Tensor]) -> None:
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_sharded_folder_is_read_tensor_by_tensor_into_the_final_dtype(tmp_path: Path) -> None:
    state = _state() | {"unused.weight": torch.ones(7)}
    _write_shards(tmp_path, state)
    source = SafetensorsFolder(tmp_path)
    assert source.shapes() == {k: tuple(v.shape) for k, v in state.items()}
    module = empty_module(Tied)
    assert all(p.is_meta for p in module.parameters())
    stats = load_weights(module, source, _layout, dtype=torch.bfloat16, device="cpu")
    assert sorted(stats.names) == sorted(set(state) - {"unused.weight"})
    assert stats.bytes == sum(state[n].numel() * 4 for n in stats.names)  # stored as float32
    assert stats.parameter_bytes == (15 + 24) * 2  # bfloat16, the tied table once
    assert module.head.weight is module.embed.weight
    assert module.embed.weight.dtype == torch.bfloat16 and not module.embed.weight.requires_grad
    assert torch.equal(module.embed.weight, state["embed.weight"].bfloat16())
    for e in range(2):
        assert torch.equal(module.stack[e, :2], state[f"e.{e}.gate"].bfloat16())
        assert torch.equal(module.stack[e, 2:], state[f"e.{e}.up"].bfloat16())


def test_a_file_mapped_afresh_between_tensors_reads_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_folder, "REMAP_BYTES", 1)  # every tensor through its own mapping
    state = _state()
    save_file(state, str(tmp_path / "model.safetensors"))
    read = {name: t.clone() for name, t in SafetensorsFolder(tmp_path).read(sorted(state))}
    assert read.keys() == state.keys()
    assert all(torch.equal(read[name], state[name]) for name in state)


def test_a_shard_the_index_names_but_lacking_a_tensor_is_named(tmp_path: Path) -> None:
    _write_shards(tmp_path, _state())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors.*ghost"):
        SafetensorsFolder(tmp_path)


def test_materialised_parameters_are_kept_and_their_tensors_not_read() -> None:
    shared = nn.Embedding(5, 3)
    module = empty_module(Tied)
    module.embed = shared  # a part loaded earlier, shared with this module
    module.head.weight = shared.weight
    stats = load_weights(
        module, StateDictSource(_state()), _layout, dtype=torch.float32, device="cpu"
    )
    assert "embed.weight" not in stats.names and len(stats.names) == 4
    assert module.embed is shared and not module.stack.is_meta


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s.pop("e.1.up"), ["missing keys ['e.1.up']"]),
        (lambda s: s.update({"embed.weight": torch.zeros(5, 4)}), ["embed.weight", "(5, 4)"]),
        (lambda s: s.update({"extra": torch.zeros(1)}), ["unexpected keys ['extra']"]),
    ],
)
def test_a_mismatch_is_listed_before_anything_is_read(
    change: Callable[[dict[str, torch.Tensor]], object], words: list[str]
) -> None:
    state = _state()
    change(state)
    module, source = empty_module(Tied), Counting(state)
    with pytest.raises(ValueError) as info:
        load_weights(
            module, source, _layout, dtype=torch.float32, device="cpu", claimed=lambda n: True
        )
    assert all(word in str(info.value) for word in words), str(info.value)
    assert source.names == []
    assert all(p.is_meta for p in module.parameters())


def test_a_layout_that_leaves_part_of_a_parameter_empty_is_refused() -> None:
    def half(name: str, shape: tuple[int, ...]) -> list[Piece]:
        return [Piece("e.0.gate", (0, slice(0, 2)))] if name == "stack" else [Piece(name)]

    with pytest.raises(ValueError, match="stack cover 6 of its elements"):
        load_weights(
            empty_module(Tied), StateDictSource(_state()), half, dtype=torch.float32, device="cpu"
        )


def test_a_tensor_made_on_meta_outside_the_parameters_is_refused() -> None:
    class Frequencies(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2))
            self.freqs = torch.arange(4)  # no explicit device: meta under empty_module

    with pytest.raises(ValueError, match="freqs is on the meta device"):
        load_weights(
            empty_module(Frequencies),
            StateDictSource({"weight": torch.ones(2)}),
            lambda name, shape: [Piece(name)],
            dtype=torch.float32,
            device="cpu",
        )
