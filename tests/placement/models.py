"""Small hand-built models for the placement tests (no weights, no engines built)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from mstar_async.graph import DynamicLoop, Edge, Model, Node, Walk
from mstar_async.models import build_model
from mstar_async.models.causal_lm import build_causal_lm
from tests.checkpoints.tiny import train_tokenizer

#: A tiny Llama's config.json (the model reads its shape to know its context limit).
TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


async def _program(request: Any) -> AsyncGenerator[Any, None]:
    yield None


def _never(step: Any) -> bool:
    return False


def demo() -> Model:
    """The zoo's demo model (its engines are factories; nothing is built)."""
    return build_model("demo")


def causal_lm(folder: Path) -> Model:
    """The zoo's causal-lm over a folder holding only a tiny tokenizer and config: building the
    model reads both, and the weights would load only when an engine is built."""
    tokenizer = train_tokenizer("gpt2")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(
        json.dumps({**TINY_CONFIG, "vocab_size": tokenizer.get_vocab_size()})
    )
    return build_causal_lm(folder)


def split_lm(name: str = "split") -> Model:
    """causal-lm's shape: nodes prefill and decode on one engine lm, one per walk, the first
    token persisted between the walks (it crosses walks through the request's state)."""
    return Model(
        name,
        nodes=[
            Node("prefill", engine="lm", inputs=["tokens"], outputs=["token"]),
            Node("decode", engine="lm", inputs=["token"], outputs=["token"]),
        ],
        edges=[Edge("prefill.token", "decode.token")],
        walks=[
            Walk("prefill", "prefill"),
            Walk("decode", DynamicLoop("decode", until=_never, max_iterations=4)),
        ],
        program=_program,
        components={"lm": object},
    )


def shared_node() -> Model:
    """One node, ``lm``, serves both walks ``prefill`` and ``decode``."""
    return Model(
        "shared",
        nodes=[Node("lm", engine="lm", inputs=["tokens"], outputs=["token"])],
        walks=[
            Walk("prefill", "lm"),
            Walk(
                "decode",
                DynamicLoop("lm", until=_never, max_iterations=4, carry={"lm.token": "lm.tokens"}),
            ),
        ],
        program=_program,
        components={"lm": object},
    )
