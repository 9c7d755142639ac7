"""A synthetic Qwen3-Omni checkpoint folder of a chosen size, in the released layout.

What the released ``Qwen3-Omni-30B-A3B`` folder has, scaled down: a ``config.json`` of
``Qwen3OmniMoeForConditionalGeneration``, bfloat16 weights sharded into about 15
``model-0000X-of-0000N.safetensors`` files with a ``model.safetensors.index.json``, per-expert
matrices (``experts.{e}.{gate,up,down}_proj.weight``), ``thinker.model.*`` names, audio and vision
tower tensors that the model never reads, and the thinker holding most of the bytes. The
tokenizer is SmolLM2's (ChatML, as Qwen's), with the three tts ids after its vocabulary.

Values are seeded uniform noise: the folder measures loading (bytes, memory, time), not
outputs; the tensor names are the ones ``tests/models/test_qwen3_omni_parity.py`` checks
against transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mstar_async.bench.common import quiet
from mstar_async.models.checkpoints import smollm2_folder
from mstar_async.models.checkpoints.streaming import empty_module
from mstar_async.models.qwen3_omni.code2wav import Code2Wav
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import build_talker

__all__ = ["OmniFolder", "omni_config_json", "write_omni_folder"]

SHARDS = 15  # as the released folder
_VOCAB = 49152  # the SmolLM2 tokenizer's
_CODEBOOK, _GROUPS = 512, 8
_TOWER_SHARE = 0.03  # of the bytes: audio and vision towers, never read


@dataclass(frozen=True)
class OmniFolder:
    """A written folder: where, its tensors' names and bytes as stored."""

    path: Path
    sizes: dict[str, int]

    def bytes_under(self, *prefixes: str) -> int:
        """Bytes of the tensors whose names start with one of ``prefixes``."""
        return sum(size for name, size in self.sizes.items() if name.startswith(prefixes))


def _text(hidden: int, layers: int, experts: int, vocab: int, **more: Any) -> dict[str, Any]:
    heads = max(hidden // 64, 2)
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "head_dim": 64,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden // 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        **more,
    }


def omni_config_json(size_bytes: int) -> dict[str, Any]:
    """A ``config.json`` whose model weighs about ``size_bytes`` in bfloat16 (the towers
    besides): the thinker's width grows with the size and its depth fills the rest.

    Raises:
        ValueError: ``size_bytes`` below 64 MB (no thinker fits).
    """
    if size_bytes < 64 * 2**20:
        raise ValueError(f"a synthetic checkpoint needs at least 64 MB, got {size_bytes} bytes")
    widths = ((256 * 2**20, 256), (2**30, 512), (8 * 2**30, 1024))
    hidden = next((width for below, width in widths if size_bytes < below), 2048)
    experts = hidden // 32
    shell = _config(hidden, experts, 1)
    one_layer = _config(hidden, experts, 2)
    params = size_bytes * (1 - _TOWER_SHARE) / 2
    fixed, per_layer = _params(shell), _params(one_layer) - _params(shell)
    layers = max(2, round((params - fixed) / per_layer) + 1)
    return _config(hidden, experts, layers)


def _config(hidden: int, experts: int, layers: int) -> dict[str, Any]:
    talker_hidden = hidden // 2
    codec = ["codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id"]
    codec += ["codec_think_bos_id", "codec_think_eos_id"]
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "thinker_config": {
            "text_config": _text(hidden, layers, experts, _VOCAB + 3),
            # A consistent tower's config (the tower's tensors below are filler of its size).
            "audio_config": {"d_model": hidden, "encoder_attention_heads": 8, "output_dim": hidden},
            "vision_config": {"hidden_size": hidden},
        },
        "talker_config": {
            "text_config": _text(
                talker_hidden,
                max(2, layers // 4),
                experts,
                _CODEBOOK + 16,
                shared_expert_intermediate_size=talker_hidden,
                norm_topk_prob=False,
            ),
            "code_predictor_config": _text(talker_hidden, 2, 0, _CODEBOOK),
            "num_code_groups": _GROUPS,
            "thinker_hidden_size": hidden,
            "speaker_id": {"Ethan": _CODEBOOK + 10},
            **{name: _CODEBOOK + i for i, name in enumerate(codec)},
        },
        "code2wav_config": {
            "codebook_size": _CODEBOOK,
            "num_quantizers": _GROUPS,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "decoder_dim": 256,
        },
        "tts_bos_token_id": _VOCAB,
        "tts_eos_token_id": _VOCAB + 1,
        "tts_pad_token_id": _VOCAB + 2,
    }


def _parts(config: dict[str, Any]) -> list[tuple[str, torch.nn.Module]]:
    cfg = OmniConfig.from_hf(config)

    return [
        ("thinker.", empty_module(lambda: Thinker(cfg.thinker, cfg.thinker_vocab))),
        ("talker.", empty_module(lambda: build_talker(cfg))),
        ("code2wav.", empty_module(lambda: Code2Wav(cfg.code2wav))),
    ]


def _params(config: dict[str, Any]) -> int:
    return sum(p.numel() for _, module in _parts(config) for p in module.parameters())


def _released_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's upstream name and shape, experts one matrix each, towers first."""
    hidden = config["thinker_config"]["text_config"]["hidden_size"]
    params = _params(config)
    tower = (hidden, 4 * hidden)
    for i in range(max(1, math.ceil(params * _TOWER_SHARE / math.prod(tower)))):
        yield f"thinker.{'audio_tower' if i % 2 else 'visual'}.blocks.{i}.mlp.fc1.weight", tower
    for prefix, module in _parts(config):
        for name, param in module.named_parameters():
            stack = name.removesuffix("gate_up_proj").removesuffix("down_proj")
            if not stack.endswith(".experts."):
                yield prefix + name, tuple(param.shape)
                continue
            experts, rows, cols = param.shape
            for e in range(experts):
                if name.endswith("down_proj"):
                    yield f"{prefix}{stack}{e}.down_proj.weight", (rows, cols)
                else:
                    yield f"{prefix}{stack}{e}.gate_proj.weight", (rows // 2, cols)
                    yield f"{prefix}{stack}{e}.up_proj.weight", (rows // 2, cols)


def write_omni_folder(
    folder: Path, size_bytes: int, *, seed: int = 0, progress: Callable[[str], None] = quiet
) -> OmniFolder:
    """Write a checkpoint of about ``size_bytes`` into ``folder`` (created; must not exist).

    Blocks on the writes (seconds per GB).

    Raises:
        ValueError: ``size_bytes`` below 64 MB.
        FileExistsError: ``folder`` exists.
    """
    config = omni_config_json(size_bytes)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, folder / name)
    shapes = list(_released_shapes(config))
    total = sum(2 * math.prod(shape) for _, shape in shapes)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for name, shape in shapes:
        if filled >= total / SHARDS:
            shards.append([])
            filled = 0
        shards[-1].append((name, shape))
        filled += 2 * math.prod(shape)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for number, members in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            name: torch.empty(shape, dtype=torch.bfloat16).uniform_(
                -0.05, 0.05, generator=generator
            )
            for name, shape in members
        }
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name], sizes[name] = file, 2 * tensor.numel()
        progress(f"wrote {file} ({sum(sizes.values()) / 2**20:.0f} of {total / 2**20:.0f} MB)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return OmniFolder(folder, sizes)
