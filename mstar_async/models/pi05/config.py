"""Sizes of the pi0.5-style policy: a Gemma-like prefix LM, an action expert, the action chunk."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mstar_async.errors import MstarError


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma-like transformer stack (the prefix LM, or the action expert).

    The expert attends to the LM's keys and values layer by layer, so both stacks share
    ``depth``, ``num_heads``, ``num_kv_heads`` and ``head_dim``; only their widths differ
    (upstream: Gemma 2B with width 2048, and a 300M expert with width 1024, both 18 layers,
    8 query heads, 1 key/value head of 256).
    """

    width: int
    mlp_dim: int
    depth: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Pi05Config:
    """A pi0.5-style policy's sizes. ``image_size`` is the side of the square camera image.

    Raises (from ``check``):
        MstarError: the expert's attention shape differs from the LM's.
    """

    lm: GemmaConfig
    expert: GemmaConfig
    action_horizon: int = 50
    action_dim: int = 32
    state_dim: int = 8
    image_size: int = 224
    #: 256 byte ids, then beginning-of-sequence and padding.
    vocab: int = 258
    state_bins: int = 256
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    seed: int = 0

    @property
    def bos_id(self) -> int:
        """The beginning-of-sequence token id."""
        return 256

    def check(self) -> Pi05Config:
        """Return ``self`` if the two stacks can attend to each other.

        Raises:
            MstarError: depth, heads or head size differ between LM and expert.
        """
        for name in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            lm, expert = getattr(self.lm, name), getattr(self.expert, name)
            if lm != expert:
                raise MstarError(
                    f"pi05: the action expert attends to the LM's keys layer by layer, so its "
                    f"{name} must equal the LM's ({expert} != {lm})"
                )
        if self.lm.num_heads % self.lm.num_kv_heads:
            raise MstarError("pi05: num_heads must be a multiple of num_kv_heads")
        return self


#: Tests: a few milliseconds per step.
TINY = Pi05Config(
    lm=GemmaConfig(width=64, mlp_dim=128, depth=2, num_heads=2, num_kv_heads=1, head_dim=16),
    expert=GemmaConfig(width=32, mlp_dim=64, depth=2, num_heads=2, num_kv_heads=1, head_dim=16),
    action_horizon=8,
    action_dim=4,
    state_dim=4,
    image_size=64,
)

#: Benchmarks: upstream's chunk (50 x 32), image size and head layout at a smaller width.
SMALL = Pi05Config(
    lm=GemmaConfig(width=256, mlp_dim=1024, depth=6, num_heads=4, num_kv_heads=1, head_dim=64),
    expert=GemmaConfig(width=128, mlp_dim=512, depth=6, num_heads=4, num_kv_heads=1, head_dim=64),
)

PRESETS = {"tiny": TINY, "small": SMALL}


def make_config(size: str = "tiny", **overrides: Any) -> Pi05Config:
    """The preset ``size`` with ``overrides`` applied to its top-level fields.

    Raises:
        MstarError: unknown size, an override names no field, or the stacks do not fit.
    """
    if size not in PRESETS:
        raise MstarError(f"pi05: size must be one of {sorted(PRESETS)}, got {size!r}")
    try:
        return replace(PRESETS[size], **overrides).check()
    except TypeError as exc:
        raise MstarError(
            f"pi05: {exc}; fields: {sorted(Pi05Config.__dataclass_fields__)}"
        ) from None
