"""Sizes of the V-JEPA 2-AC world model: an encoder ViT and an action-conditioned predictor."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class VJEPA2Config:
    """One V-JEPA 2-AC configuration (upstream names in brackets).

    A frame of ``image_size`` pixels is cut into ``patch_size`` patches, so it has
    ``grid ** 2`` patch tokens; the predictor adds an action and a state token before them
    (``cond_tokens``), so a frame is ``tokens_per_frame`` predictor tokens. Upstream's released
    model: 256 px, 16 px patches (256 tokens), a ViT-g encoder (1408 wide) and a 24-layer,
    1024-wide predictor with 16 heads, 7-dimensional actions and states.

    Raises:
        ValueError: sizes that do not divide (image by patch, width by heads), or an odd head
            dimension (the rotary embedding rotates pairs).
    """

    image_size: int = 32
    patch_size: int = 8
    tubelet_size: int = 2  # [tubelet_size] a frame is repeated to fill one tubelet
    in_chans: int = 3
    encoder_dim: int = 32  # [embed_dim]
    encoder_depth: int = 2
    encoder_heads: int = 2
    predictor_dim: int = 48  # [predictor_embed_dim]
    predictor_depth: int = 2
    predictor_heads: int = 2
    mlp_ratio: float = 4.0  # the predictor's
    encoder_mlp_ratio: float = 4.0
    action_dim: int = 7  # [action_embed_dim] xyz, euler xyz, gripper
    cond_tokens: int = 2  # action and state tokens per frame (upstream without extrinsics)
    context_frames: int = 2  # frames encoded when a request brings no video
    kv_frames: int = 64  # frames of predictor KV the engine holds, all requests together
    max_horizon: int = 256
    seed: int = 0
    checkpoint: str | None = None  # an upstream .pt file; its weights replace the seeded ones

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}"
            )
        for dim, heads, name in (
            (self.encoder_dim, self.encoder_heads, "encoder"),
            (self.predictor_dim, self.predictor_heads, "predictor"),
        ):
            if dim % heads or (dim // heads) % 2:
                raise ValueError(f"{name}_dim {dim} must split into {heads} heads of an even size")

    @property
    def grid(self) -> int:
        """Patches along each side of a frame."""
        return self.image_size // self.patch_size

    @property
    def patches_per_frame(self) -> int:
        """Latent tokens per frame (what the encoder makes and the predictor predicts)."""
        return self.grid**2

    @property
    def tokens_per_frame(self) -> int:
        """Predictor tokens per frame: action, state, then the patches."""
        return self.cond_tokens + self.patches_per_frame


#: Named sizes. ``tiny`` runs the tests in milliseconds; ``small`` keeps upstream's shape of a
#: frame (a 8x8 grid of 16-px patches, 64 + 2 predictor tokens: upstream has 16x16 at 256 px)
#: at a width and depth a CPU rolls out 30 frames with in seconds.
SIZES: dict[str, VJEPA2Config] = {
    "tiny": VJEPA2Config(),
    "small": VJEPA2Config(
        image_size=128,
        patch_size=16,
        encoder_dim=192,
        encoder_depth=2,
        encoder_heads=3,
        predictor_dim=192,
        predictor_depth=4,
        predictor_heads=4,
        context_frames=1,
        kv_frames=320,
    ),
    # Upstream's released V-JEPA 2-AC shape (ViT-g encoder, 24-layer predictor), for its
    # checkpoint: build_model("vjepa2", size="vitg", checkpoint="vjepa2-ac-vitg.pt").
    "vitg": VJEPA2Config(
        image_size=256,
        patch_size=16,
        encoder_dim=1408,
        encoder_depth=40,
        encoder_heads=22,
        encoder_mlp_ratio=48 / 11,
        predictor_dim=1024,
        predictor_depth=24,
        predictor_heads=16,
        context_frames=1,
        kv_frames=32,
    ),
}


def make_config(size: str = "tiny", **overrides: Any) -> VJEPA2Config:
    """The configuration ``size`` with ``overrides`` applied.

    Raises:
        ValueError: an unknown size.
        TypeError: an override names no field.
    """
    if size not in SIZES:
        raise ValueError(f"unknown vjepa2 size {size!r}; sizes: {sorted(SIZES)}")
    return replace(SIZES[size], **overrides)
