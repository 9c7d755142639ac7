"""Reading Hugging Face folders, and ChatTokenizer against transformers on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mstar_async.errors import MstarError
from mstar_async.models.checkpoints import (
    ChatTemplateError,
    ChatTokenizer,
    CheckpointError,
    ConversationRejected,
    load_checkpoint,
)
from tests.checkpoints.tiny import (
    FANCY_TEMPLATE,
    USER_TOKEN,
    make_llama,
    train_tokenizer,
    write_hf_folder,
)

CONVERSATION = [
    {"role": "system", "content": "Be <brief> & 'exact'."},
    {"role": "user", "content": "skip me"},
    {"role": "user", "content": "héllo 世界 🙂 — 42?"},
    {"role": "assistant", "content": "Sure."},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = train_tokenizer("smollm")
    model = make_llama(tokenizer.get_vocab_size(), tied=False)
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    write_hf_folder(folder, model, tokenizer, chat_template=FANCY_TEMPLATE, eos_ids=[2, 0])
    return model, tokenizer, folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def test_load_checkpoint_reads_config_weights_and_tokenizer(saved: Any) -> None:
    model, _, folder = saved
    checkpoint = load_checkpoint(folder)
    assert checkpoint.path == folder
    assert checkpoint.config["num_hidden_layers"] == 2
    assert checkpoint.config["model_type"] == "llama"
    original = model.state_dict()
    assert set(checkpoint.state_dict) == set(original)
    for name, tensor in checkpoint.state_dict.items():
        assert torch.equal(tensor, original[name]), name
    assert isinstance(checkpoint.tokenizer, ChatTokenizer)
    assert checkpoint.tokenizer.eos_token_ids == frozenset({0, 2})


def test_dtype_casts_floating_tensors(saved: Any) -> None:
    _, _, folder = saved
    checkpoint = load_checkpoint(folder, dtype=torch.bfloat16)
    assert {t.dtype for t in checkpoint.state_dict.values()} == {torch.bfloat16}


def test_sharded_weights(saved: Any, tmp_path: Path) -> None:
    model, _, folder = saved
    target = _copy(folder, tmp_path)
    (target / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(target / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = load_checkpoint(target)
    assert set(checkpoint.state_dict) == set(state)
    assert all(torch.equal(checkpoint.state_dict[k], state[k]) for k in state)

    (target / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        load_checkpoint(target)


@pytest.mark.parametrize(
    ("removed", "named"),
    [
        ("config.json", r"config\.json"),
        ("tokenizer.json", r"tokenizer\.json"),
        ("model.safetensors", r"model\.safetensors"),
    ],
)
def test_missing_files_are_named(saved: Any, tmp_path: Path, removed: str, named: str) -> None:
    _, _, folder = saved
    target = _copy(folder, tmp_path)
    (target / removed).unlink()
    with pytest.raises(CheckpointError, match=named) as info:
        load_checkpoint(target)
    assert isinstance(info.value, MstarError)
    assert "put" in str(info.value)


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a folder"):
        load_checkpoint(tmp_path / "nowhere")


def test_encode_matches_transformers(saved: Any) -> None:
    from transformers import AutoTokenizer

    _, _, folder = saved
    ours = ChatTokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in [
        "The capital of France is Paris.",
        "héllo 世界 🙂 — 2024-01-31",
        f"<|im_start|>user\n{USER_TOKEN} hi<|im_end|>",
        "",
    ]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(saved: Any, add_generation_prompt: bool) -> None:
    from transformers import AutoTokenizer

    _, _, folder = saved
    ours = ChatTokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    rendered = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    expected = theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert "\"Be <brief> & 'exact'.\"" in rendered  # tojson does not HTML-escape
    assert "skip me" not in rendered
    assert rendered.startswith("<|im_start|>")


def test_template_raise_exception_and_missing_template(saved: Any, tmp_path: Path) -> None:
    _, _, folder = saved
    ours = ChatTokenizer.from_folder(folder)
    with pytest.raises(ChatTemplateError, match="unknown role tool") as rejected:
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    # The conversation is at fault, not the checkpoint: a server answers 400 for a ValueError.
    assert isinstance(rejected.value, ConversationRejected) and isinstance(
        rejected.value, ValueError
    )
    target = _copy(folder, tmp_path)
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="chat_template"):
        ChatTokenizer.from_folder(target).apply_chat_template(CONVERSATION)


def test_template_in_tokenizer_config(saved: Any, tmp_path: Path) -> None:
    _, _, folder = saved
    target = _copy(folder, tmp_path)
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages | length }}{{ eos_token }}"
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "generation_config.json").unlink()
    ours = ChatTokenizer.from_folder(target)
    assert ours.apply_chat_template(CONVERSATION) == "4<|endoftext|>"
    assert ours.eos_token_ids == frozenset({0})
