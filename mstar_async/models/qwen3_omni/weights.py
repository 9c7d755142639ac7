"""The three modules of the model (thinker, talker with its code predictor, code2wav), with
seeded weights or loaded from a checkpoint's state dict by upstream names.

Modules are built once per (source, dtype, device) in a process and shared by the engines that
need them: the talker's engine and the code predictor's engine read the same ``Talker``, and
the talker's engine reads the thinker's embedding table (upstream projects thinker embeddings
into the talker).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mstar_async.models.checkpoints import load_checkpoint
from mstar_async.models.qwen3_omni.code2wav import Code2Wav
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.talker import Talker
from mstar_async.models.qwen3_omni.thinker import Thinker

__all__ = ["OmniParts", "build_parts", "fuse_expert_keys", "load_part", "upstream_keys"]


@dataclass(frozen=True)
class OmniParts:
    """The model's modules, in eval mode."""

    thinker: Thinker
    talker: Talker
    code2wav: Code2Wav


def _modules(cfg: OmniConfig) -> OmniParts:
    return OmniParts(
        thinker=Thinker(cfg.thinker, cfg.thinker_vocab),
        talker=Talker(
            cfg.talker,
            vocab=cfg.talker_vocab,
            thinker_hidden=cfg.thinker.hidden_size,
            predictor=cfg.predictor,
            codebook_size=cfg.codebook_size,
            groups=cfg.num_code_groups,
        ),
        code2wav=Code2Wav(cfg.code2wav),
    )


_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack per-expert ``experts.{e}.{gate,up,down}_proj.weight`` (the layout of the released
    safetensors) into transformers 5's fused ``experts.gate_up_proj`` / ``experts.down_proj``;
    other keys pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in state.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        prefix, index, name = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(name, {})[index] = value
    for prefix, parts in experts.items():
        count = len(parts["down_proj"])
        gate = [parts["gate_proj"][e] for e in range(count)]
        up = [parts["up_proj"][e] for e in range(count)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    return out


def upstream_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Normalise a checkpoint's keys to this model's: fused experts, and transformers 5's
    ``thinker.model.language_model.`` read as the released files' ``thinker.model.``."""
    renamed = {
        k.replace("thinker.model.language_model.", "thinker.model.", 1): v for k, v in state.items()
    }
    return fuse_expert_keys(renamed)


def load_part(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Load the ``prefix``-ed keys of ``state`` into ``module`` strictly.

    Raises:
        ValueError: keys missing or unexpected, or shapes differ (the message lists them).
    """
    mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    expected = module.state_dict()
    missing = sorted(set(expected) - set(mine))
    unexpected = sorted(set(mine) - set(expected))
    wrong = sorted(
        f"{k}: checkpoint {tuple(mine[k].shape)}, model {tuple(expected[k].shape)}"
        for k in set(mine) & set(expected)
        if mine[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"state dict under {prefix!r} does not match the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}, shape mismatches {wrong[:8]}"
        )
    with torch.no_grad():
        module.load_state_dict(mine, strict=True)


#: The RMS level seeded code2wav weights are scaled to (about -20 dBFS): random weights
#: otherwise drive most samples into the [-1, 1] clamp, which is noise at full scale.
SEEDED_RMS = 0.1


def _speak_softly(code2wav: Code2Wav, seed: int) -> None:
    """Scale the seeded vocoder's last convolution so random codes come out at ``SEEDED_RMS``
    (deterministic for the seed; real checkpoints are never touched)."""
    cfg = code2wav.config
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.codebook_size, (cfg.num_quantizers, 16), generator=generator)
    last = code2wav.decoder[-1]
    assert isinstance(last, nn.Module)
    with torch.no_grad():
        rms = float(code2wav.unclamped(codes).pow(2).mean().sqrt())
        if rms > 0:
            for param in last.parameters():
                param.mul_(SEEDED_RMS / rms)


# The thinker's audio / vision towers are not part of this model; their keys are skipped.
_PREFIXES = {"thinker": "thinker.", "talker": "talker.", "code2wav": "code2wav."}


@functools.lru_cache(maxsize=4)
def build_parts(cfg: OmniConfig, folder: Path | None, dtype: torch.dtype, device: str) -> OmniParts:
    """The modules for ``cfg``: seeded from ``cfg.seed`` when ``folder`` is None, else loaded
    from the folder's weights. Cached per arguments.

    Raises:
        CheckpointError: a weight file is missing or unreadable.
        ValueError: the weights do not match the config.
    """
    parts = _modules(cfg)
    if folder is None:
        for offset, module in enumerate((parts.thinker, parts.talker, parts.code2wav)):
            seeded_init(module, cfg.seed + offset)
        _speak_softly(parts.code2wav, cfg.seed + 2)
    else:
        state = upstream_keys(load_checkpoint(folder).state_dict)
        thinker_state = {
            k: v for k, v in state.items() if k.startswith(("thinker.model.", "thinker.lm_head."))
        }
        load_part(parts.thinker, thinker_state, _PREFIXES["thinker"])
        load_part(parts.talker, state, _PREFIXES["talker"])
        load_part(parts.code2wav, state, _PREFIXES["code2wav"])
    for module in (parts.thinker, parts.talker, parts.code2wav):
        module.to(device=device, dtype=dtype).eval()
    return parts
