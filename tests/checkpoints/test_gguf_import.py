"""GGUF -> Hugging Face folder import, checked by round-tripping tiny random Llama models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from mstar_async.errors import MstarError
from mstar_async.models.checkpoints import (
    ChatTokenizer,
    CheckpointError,
    import_gguf,
    is_imported_folder,
    load_checkpoint,
)
from mstar_async.models.checkpoints.llama_layout import (
    deinterleave_rope_rows,
    gguf_name,
    hf_name,
    interleave_rope_rows,
)
from tests.checkpoints.tiny import (
    CHATML_TEMPLATE,
    USER_TOKEN,
    make_llama,
    reference_permute,
    train_tokenizer,
    write_gguf,
)

CASES = [
    pytest.param((True, "smollm"), id="tied-smollm"),
    pytest.param((False, "gpt2"), id="untied-gpt2"),
]

SAMPLES = [
    "The capital of France is Paris.",
    "héllo 世界 🙂 and 12345 apples",
    f"<|im_start|>user\nhi {USER_TOKEN}<|im_end|>\n",
    "  spaces\tand\nnewlines  ",
]


@pytest.fixture(scope="module", params=CASES)
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tied, pre = request.param
    tokenizer = train_tokenizer(pre)
    model = make_llama(tokenizer.get_vocab_size(), tied=tied)
    root = tmp_path_factory.mktemp(f"gguf-{pre}")
    write_gguf(root / "tiny.gguf", model, tokenizer, pre=pre, chat_template=CHATML_TEMPLATE)
    folder = import_gguf(root / "tiny.gguf", root / "imported", progress=None)
    return model, tokenizer, folder, tied


def test_every_tensor_round_trips_exactly(imported: Any) -> None:
    model, _, folder, tied = imported
    checkpoint = load_checkpoint(folder)
    original = model.state_dict()
    expected = set(original) - ({"lm_head.weight"} if tied else set())
    assert set(checkpoint.state_dict) == expected
    for name, tensor in checkpoint.state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, original[name]), name


def test_config_matches_the_original(imported: Any) -> None:
    model, tokenizer, folder, tied = imported
    config = json.loads((folder / "config.json").read_text())
    source = model.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert config[key] == getattr(source, key), key
    assert config["rope_parameters"]["rope_theta"] == source.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(source.rms_norm_eps)
    assert config["tie_word_embeddings"] is tied
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert is_imported_folder(folder)


def test_transformers_gives_the_same_logits(imported: Any) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer, folder, _ = imported
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(SAMPLES[1]).ids])
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
        # The test is only meaningful if a wrong q/k row order would change the logits.
        state = loaded.state_dict()
        heads = loaded.config.num_attention_heads
        state["model.layers.0.self_attn.q_proj.weight"] = reference_permute(
            state["model.layers.0.self_attn.q_proj.weight"], heads
        )
        loaded.load_state_dict(state)
        assert not torch.allclose(loaded(ids).logits, expected, atol=1e-3)


def test_tokenizer_round_trips(imported: Any) -> None:
    from transformers import AutoTokenizer

    _, tokenizer, folder, _ = imported
    ours = ChatTokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert ours.vocab_size == tokenizer.get_vocab_size()
    assert ours.eos_token_ids == frozenset({2})
    assert ours.bos_token_id == 1
    for text in SAMPLES:
        ids = tokenizer.encode(text).ids
        assert ours.encode(text) == ids, text
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "Hi!"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")


def test_library_permutation_matches_llama_cpp_order() -> None:
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    assert torch.equal(interleave_rope_rows(weight, 2), reference_permute(weight, 2))
    assert torch.equal(deinterleave_rope_rows(reference_permute(weight, 2), 2), weight)
    with pytest.raises(CheckpointError, match="heads"):
        deinterleave_rope_rows(weight, 3)


def test_name_mapping_is_a_bijection() -> None:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.7.{part}.weight"
        for part in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    ]
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.7.ffn_norm.weight") == "model.layers.7.post_attention_layernorm.weight"
    assert [gguf_name(hf_name(n)) for n in names] == names
    assert len({hf_name(n) for n in names}) == len(names)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.bias"):
        hf_name("blk.0.attn_q.bias")


def _rewrite(source: Path, target: Path, **overrides: Any) -> None:
    """Copy a GGUF, replacing string metadata fields (a minimal writer for error cases)."""
    reader = gguf.GGUFReader(source)
    arch = overrides.get("general.architecture", "llama")
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = overrides.get(name, field.contents())
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(
            tensor.name,
            tensor.data.copy(),
            raw_shape=tensor.data.shape,
            raw_dtype=tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_files_are_refused(imported: Any, tmp_path: Path) -> None:
    _, _, folder, _ = imported
    source = folder.parent / "tiny.gguf"
    with pytest.raises(CheckpointError, match=r"missing\.gguf"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=None)
    with pytest.raises(CheckpointError, match="already exists"):
        import_gguf(source, folder, progress=None)

    odd_pre = tmp_path / "pre.gguf"
    _rewrite(source, odd_pre, **{"tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(CheckpointError, match="llama-bpe"):
        import_gguf(odd_pre, tmp_path / "out", progress=None)

    not_llama = tmp_path / "arch.gguf"
    _rewrite(source, not_llama, **{"general.architecture": "qwen2"})
    with pytest.raises(MstarError, match="qwen2"):
        import_gguf(not_llama, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_overwrite_replaces_the_folder_atomically(imported: Any, tmp_path: Path) -> None:
    _, _, folder, _ = imported
    target = tmp_path / "target"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    import_gguf(folder.parent / "tiny.gguf", target, overwrite=True, progress=None)
    assert not (target / "stale.txt").exists()
    assert is_imported_folder(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_progress_reports_each_stage(imported: Any, tmp_path: Path) -> None:
    _, _, folder, _ = imported
    lines: list[str] = []
    import_gguf(folder.parent / "tiny.gguf", tmp_path / "out", progress=lines.append)
    assert any("dequantized" in line for line in lines)
    assert any("model.safetensors" in line for line in lines)
    assert lines[-1].startswith("imported")


def test_add_bos_token_flag_matches_transformers(imported: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _, _, folder, _ = imported
    with_bos = tmp_path / "bos.gguf"
    _rewrite(folder.parent / "tiny.gguf", with_bos, **{"tokenizer.ggml.add_bos_token": True})
    out = import_gguf(with_bos, tmp_path / "out", progress=None)
    ours = ChatTokenizer.from_folder(out)
    theirs = AutoTokenizer.from_pretrained(out)
    for text in ["hello there", ""]:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids[0] == 1
        assert ids == theirs(text)["input_ids"]
        assert ours.encode(text) == ids[1:]
