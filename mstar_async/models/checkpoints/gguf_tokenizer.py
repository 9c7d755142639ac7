"""Rebuilding a Hugging Face ``tokenizer.json`` from a GGUF file's ``tokenizer.ggml.*`` fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mstar_async.models.checkpoints.errors import CheckpointError

# llama.cpp token types (tokenizer.ggml.token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# tokenizer.ggml.pre names whose pre-tokenizer is the GPT-2 byte-level regex, optionally preceded
# by splitting every digit into its own piece (the StarCoder family, which SmolLM belongs to).
# Others use different regexes; guessing would tokenize subtly wrong, so they are refused.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_GPT2_ONLY = frozenset({"gpt2", "mpt", "olmo", "jais"})
SUPPORTED_PRE = _DIGITS_THEN_GPT2 | _GPT2_ONLY


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise CheckpointError(f"the GGUF file has no {key!r} field to rebuild the tokenizer from")
    return meta[key]


def _token_at(tokens: list[str], meta: Mapping[str, Any], key: str) -> str | None:
    token_id = meta.get(key)
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise CheckpointError(f"GGUF {key}={token_id} is outside the {len(tokens)}-token vocab")
    return tokens[int(token_id)]


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equal to the one the GGUF was made from.

    ``meta`` maps GGUF keys to values. Needs ``tokenizer.ggml.model == "gpt2"``, a supported
    ``tokenizer.ggml.pre`` (see ``SUPPORTED_PRE``), ``tokens``, ``merges`` and optionally
    ``token_type`` (control and unknown tokens become special tokens, user-defined ones added
    tokens). Raises ``CheckpointError`` on anything else.
    """
    kind = _require(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in SUPPORTED_PRE:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.pre is {pre!r}; supported pre-tokenizers: {sorted(SUPPORTED_PRE)}"
        )
    tokens = [str(t) for t in _require(meta, "tokenizer.ggml.tokens")]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError("GGUF tokenizer.ggml.tokens holds duplicate tokens")
    merges: list[tuple[str, str]] = []
    for merge in _require(meta, "tokenizer.ggml.merges"):
        left, sep, right = str(merge).partition(" ")
        if not sep:
            raise CheckpointError(f"GGUF merge {merge!r} is not two tokens separated by a space")
        merges.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [])]
    # Added tokens keep their vocabulary ids because every one of them is already in `vocab`.
    special = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
    added = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

    tokenizer.post_processor = _post_processor(tokens, meta)
    return tokenizer


def _post_processor(tokens: list[str], meta: Mapping[str, Any]) -> Any:
    bos = _token_at(tokens, meta, "tokenizer.ggml.bos_token_id")
    eos = _token_at(tokens, meta, "tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    head = f"{bos}:0 " if add_bos else ""
    tail = f" {eos}:0" if add_eos else ""
    pair_head = f" {bos}:1" if add_bos else ""
    pair_tail = f" {eos}:1" if add_eos else ""
    used = {t for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None}
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail}{pair_head} $B:1{pair_tail}",
        special_tokens=[(t, tokens.index(t)) for t in sorted(used)],  # at most two lookups
    )


def tokenizer_config(meta: Mapping[str, Any], model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents (special tokens, chat template) for a GGUF file.

    Raises ``CheckpointError`` if a special-token id in ``meta`` is outside the vocabulary.
    """
    tokens = [str(t) for t in _require(meta, "tokenizer.ggml.tokens")]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token = _token_at(tokens, meta, f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{role}_token"] = token
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
