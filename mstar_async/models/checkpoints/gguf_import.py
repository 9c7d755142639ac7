"""Converting a Llama-architecture GGUF file into a Hugging Face-style checkpoint folder.

Every tensor is dequantized to float32 and stored as float32: GGUF's block formats rebuild a
weight as ``scale * q (+ min)`` with float16 scales, and those products generally need more
mantissa bits than bfloat16 or float16 have, so a narrower dtype would not reproduce what was
dequantized. The price is disk space (about 4 bytes per parameter).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.gguf_tensors import GGUFTensors
from mstar_async.models.checkpoints.gguf_tokenizer import build_tokenizer, tokenizer_config
from mstar_async.models.checkpoints.staging import publish, staging_dir

IMPORT_MARKER = ".mstar_import.json"
IMPORT_FORMAT_VERSION = 1

# Receives one human-readable line per conversion stage.
Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    """Write one progress line to stderr (the default ``progress`` for conversions)."""
    print(f"[mstar_async] {message}", file=sys.stderr, flush=True)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field of an open GGUF file, as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise CheckpointError(f"the GGUF file has no {key!r} field, which a Llama model needs")
    return int(value)


def llama_config(meta: Mapping[str, Any], *, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The ``config.json`` for ``LlamaForCausalLM`` described by GGUF metadata ``meta``.

    Raises ``CheckpointError`` if a required ``llama.*`` field is missing or the file asks for
    something this layout cannot express (partial rotary dims, non-linear rope scaling).
    """
    hidden = _int(meta, "llama.embedding_length")
    heads = _int(meta, "llama.attention.head_count")
    kv_heads = _int(meta, "llama.attention.head_count_kv", heads)
    head_dim = _int(meta, "llama.attention.key_length", hidden // heads)
    rope_dim = _int(meta, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(
            f"GGUF llama.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            "partial rotary embeddings are not supported"
        )
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling != "none":
        raise CheckpointError(f"GGUF rope scaling {scaling!r} is not supported (only 'linear')")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _int(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(meta, "llama.context_length"),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        # Both spellings, so transformers 4.x (rope_theta) and 5.x (rope_parameters) agree.
        "rope_theta": theta,
        "rope_parameters": rope,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": rope["factor"]}
    for role in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None:
            config[f"{role}_token_id"] = int(token_id)
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return config


def generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` for GGUF metadata ``meta``.

    ``eos_token_id`` lists every id that ends a turn: eos, end-of-turn and end-of-message.
    """
    stops: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in stops:
            stops.append(int(value))
    config: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return config


def read_llama_weights(
    path: Path, config: Mapping[str, Any], progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of the GGUF file ``path`` to float32 under its Hugging Face name.

    Shapes come out as torch expects them (``[out_features, in_features]``) and q/k rows are put
    back in Hugging Face rotary order (``GGUFTensors.read``). Raises ``CheckpointError`` for a
    tensor with no Llama counterpart or a type that cannot be dequantized.
    """
    source = GGUFTensors(path, config)
    names = list(source.shapes())
    state: dict[str, torch.Tensor] = {}
    for done, (name, weight) in enumerate(source.read(names), start=1):
        state[name] = weight
        if progress is not None and (done == len(names) or done % max(1, len(names) // 10) == 0):
            progress(f"dequantized {done}/{len(names)} tensors")
    return state


def _check_weights(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        expected |= {
            prefix + part + ".weight"
            for part in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        }
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"the GGUF file lacks tensors a Llama model needs: {missing[:5]}")
    rows = state["model.embed_tokens.weight"].shape[0]
    if rows != config["vocab_size"]:
        raise CheckpointError(
            f"GGUF token_embd has {rows} rows but the tokenizer has {config['vocab_size']} tokens"
        )


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: Progress | None = stderr_progress,
) -> Path:
    """Convert the Llama GGUF file ``gguf_path`` into a Hugging Face folder at ``out_dir``.

    Writes ``config.json``, ``generation_config.json``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``model.safetensors`` (float32) and a completion marker, into a
    temporary folder beside ``out_dir`` that is renamed into place only when complete.
    ``progress`` receives one line per stage (``None`` silences it). Returns ``out_dir``.
    Raises ``CheckpointError`` if the file is missing or not a supported Llama GGUF, or if
    ``out_dir`` already holds something and ``overwrite`` is false.
    """
    source = Path(gguf_path)
    target = Path(out_dir)
    say = progress or (lambda _message: None)
    if not source.is_file():
        raise CheckpointError(f"{source} is missing: pass the path of a .gguf file")
    if not overwrite and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target} already exists and is not empty; pass overwrite=True")
    started = time.monotonic()
    say(f"importing {source.name} -> {target}")
    try:
        reader = GGUFReader(source)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {source} as GGUF: {exc}") from exc
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{source} is a {arch!r} GGUF; only the 'llama' architecture can be imported"
        )

    tokenizer = build_tokenizer(meta)
    vocab_size = len(meta["tokenizer.ggml.tokens"])
    say(f"tokenizer: {vocab_size} tokens, {len(meta['tokenizer.ggml.merges'])} merges")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = llama_config(meta, vocab_size=vocab_size, tied=tied)
    state = read_llama_weights(source, config, say)
    _check_weights(state, config)
    n_params = sum(t.numel() for t in state.values())

    with staging_dir(target) as staging:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(meta))
        _write_json(
            staging / "tokenizer_config.json",
            tokenizer_config(meta, int(config["max_position_embeddings"])),
        )
        tokenizer.save(str(staging / "tokenizer.json"))
        say(f"writing model.safetensors ({n_params * 4 / 2**20:.0f} MiB float32)")
        weights_path = staging / "model.safetensors"
        save_file(state, str(weights_path), metadata={"format": "pt"})
        weights_path.chmod(0o644)  # safetensors creates it owner-only
        marker = {
            "format_version": IMPORT_FORMAT_VERSION,
            "source": source.name,
            "source_bytes": source.stat().st_size,
            "weights_dtype": "float32",
        }
        # Written last: its presence means everything above is complete.
        _write_json(staging / IMPORT_MARKER, marker)
        if not publish(staging, target, replace=overwrite):
            raise CheckpointError(f"{target} appeared while converting; pass overwrite=True")
    say(f"imported {n_params / 1e6:.1f}M parameters in {time.monotonic() - started:.1f}s")
    return target


def is_imported_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is a complete ``import_gguf`` output in the current format."""
    marker = Path(folder) / IMPORT_MARKER
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format_version") == IMPORT_FORMAT_VERSION
