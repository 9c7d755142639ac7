"""GGUF tensors read directly: the tensor table against ``gguf.GGUFReader``, blocks against
``gguf.quants.dequantize`` bit for bit, and the int4 kernel against both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf.quants import dequantize, quantize

from mstar_async.models.checkpoints import CheckpointError
from mstar_async.models.checkpoints.gguf_tensors import (
    BLOCK_TYPES,
    GGUFTensors,
    decode_blocks,
    tensor_table,
)
from mstar_async.models.checkpoints.llama_layout import deinterleave_rope_rows
from mstar_async.models.quant import QuantizedWeight, QuantLinear, fit
from tests.checkpoints.tiny import CHATML_TEMPLATE, make_llama, train_tokenizer, write_gguf

# Every weight type a tiny file mixes: each block format, float16 and float32.
KINDS = {
    "token_embd.weight": Kind.Q8_0,
    "blk.0.attn_q.weight": Kind.Q4_1,
    "blk.0.attn_k.weight": Kind.Q4_0,
    "blk.0.attn_v.weight": Kind.Q8_0,
    "blk.0.ffn_up.weight": Kind.F16,
    "blk.1.attn_q.weight": Kind.Q4_0,
    "blk.1.attn_k.weight": Kind.Q4_1,
    "blk.1.ffn_gate.weight": Kind.Q4_1,
    "blk.1.ffn_down.weight": Kind.Q4_0,
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tokenizer = train_tokenizer("gpt2")
    model = make_llama(tokenizer.get_vocab_size(), tied=True)
    path = tmp_path_factory.mktemp("gguf-mixed") / "mixed.gguf"
    write_gguf(path, model, tokenizer, pre="gpt2", chat_template=CHATML_TEMPLATE, kinds=KINDS)
    return path, model.config.to_dict()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_blocks_decode_bit_for_bit_as_gguf_dequantizes(kind: Kind) -> None:
    gen = np.random.default_rng(int(kind))
    # Rows over eight orders of magnitude, negative and positive: scales of every size.
    values = gen.standard_normal((24, 256)) * np.logspace(-4, 4, 24)[:, None]
    raw = quantize(values.astype(np.float32), kind)
    weight = decode_blocks(raw, kind, 256)
    want = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32).copy())
    assert torch.equal(_bits(weight.dequantize()), _bits(want))
    assert weight.bits == (8 if kind == Kind.Q8_0 else 4)
    assert (weight.offsets is not None) == (kind == Kind.Q4_1)


def test_negative_scales_and_zero_codes_keep_their_sign_bits() -> None:
    # A Q4_0 block with d = -0.5 and every code 8 (weight 0): gguf gives -0.0.
    block = np.zeros((1, 18), dtype=np.uint8)
    block[0, :2] = np.array([-0.5], dtype=np.float16).view(np.uint8)
    block[0, 2:] = 0x88
    got = decode_blocks(block, Kind.Q4_0, 32).dequantize()
    want = torch.from_numpy(np.asarray(dequantize(block, Kind.Q4_0), dtype=np.float32).copy())
    assert torch.equal(_bits(got), _bits(want.reshape(1, 32)))
    assert torch.signbit(got).all()


def test_wrong_sizes_are_refused() -> None:
    with pytest.raises(CheckpointError, match="bytes per row"):
        decode_blocks(np.zeros((2, 35), dtype=np.uint8), Kind.Q8_0, 32)
    with pytest.raises(CheckpointError, match="not read as codes"):
        decode_blocks(np.zeros((2, 64), dtype=np.uint8), Kind.Q5_0, 32)


def test_tensor_table_matches_gguf_reader(mixed: tuple[Path, dict[str, Any]]) -> None:
    path, _ = mixed
    table = tensor_table(path)
    reader = gguf.GGUFReader(path)
    assert set(table) == {t.name for t in reader.tensors}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in reader.tensors:
        entry = table[tensor.name]
        assert entry.kind == tensor.tensor_type
        assert entry.dims == tuple(int(d) for d in tensor.shape)
        assert entry.nbytes == tensor.n_bytes
        assert bytes(data[entry.offset : entry.offset + entry.nbytes]) == tensor.data.tobytes()
    assert {e.kind for e in table.values()} >= {*BLOCK_TYPES, Kind.F16, Kind.F32}


def test_read_is_gguf_dequantization_with_rope_rows_reordered(
    mixed: tuple[Path, dict[str, Any]],
) -> None:
    path, config = mixed
    source = GGUFTensors(path, config)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    expected = {
        "model.embed_tokens.weight": ("token_embd.weight", None),
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", 4),
        "model.layers.1.self_attn.k_proj.weight": ("blk.1.attn_k.weight", 2),
        "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", None),
        "model.norm.weight": ("output_norm.weight", None),
    }
    for name, tensor in source.read(list(expected)):
        gguf_name, heads = expected[name]
        raw = reader[gguf_name]
        values = np.asarray(dequantize(raw.data, raw.tensor_type), dtype=np.float32)
        want = torch.from_numpy(values.copy()).reshape(tensor.shape)
        if heads is not None:
            want = deinterleave_rope_rows(want, heads)
        assert torch.equal(_bits(tensor), _bits(want)), name


def test_read_quantized_keeps_blocks_and_reorders_their_rows(
    mixed: tuple[Path, dict[str, Any]],
) -> None:
    path, config = mixed
    source = GGUFTensors(path, config)
    names = [
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, rope rows
        "model.layers.0.self_attn.v_proj.weight",  # Q8_0
        "model.layers.0.mlp.up_proj.weight",  # F16: as read() gives it
    ]
    read = dict(source.read_quantized(names))
    floats = dict(source.read(names))
    q_proj, v_proj = read[names[0]], read[names[1]]
    assert isinstance(q_proj, QuantizedWeight) and q_proj.offsets is not None
    assert isinstance(v_proj, QuantizedWeight) and v_proj.bits == 8
    assert isinstance(read[names[2]], torch.Tensor)
    for name in names[:2]:
        weight = read[name]
        assert isinstance(weight, QuantizedWeight)
        assert torch.equal(_bits(weight.dequantize()), _bits(floats[name])), name


def test_int4_kernel_multiplies_q4_blocks_exactly_in_float32(
    mixed: tuple[Path, dict[str, Any]],
) -> None:
    path, config = mixed
    source = GGUFTensors(path, config)
    names = [
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1
        "model.layers.0.self_attn.k_proj.weight",  # Q4_0
        "model.layers.1.mlp.gate_proj.weight",  # Q4_1
        "model.layers.1.mlp.down_proj.weight",  # Q4_0
    ]
    floats = dict(source.read(names))
    for name, weight in source.read_quantized(names):
        assert isinstance(weight, QuantizedWeight)
        layer = QuantLinear(fit(weight, "int4"), None, dtype=torch.float32)
        cols = weight.shape[1]
        got = layer(torch.eye(cols)).t()  # one weight times 1 per output: exact
        # Equal values; a Q4_0 zero of a negative scale comes out +0.0 where gguf has -0.0,
        # which no product or sum can tell apart.
        assert torch.equal(got, floats[name]), name
        assert torch.equal(_bits(got[got != 0]), _bits(floats[name][got != 0])), name


def test_cut_or_foreign_files_are_refused(tmp_path: Path, mixed: tuple[Path, Any]) -> None:
    path, _ = mixed
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cut short"):
        tensor_table(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        tensor_table(foreign)
