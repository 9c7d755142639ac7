"""Rectified-flow sampling: the timestep schedule, and one guided Euler step (BAGEL's CFG).

The latent moves from noise at ``t = 1`` to an image latent at ``t = 0``; the model predicts the
velocity ``v = noise - x0``, so one step is ``x <- x - v * (t_i - t_{i+1})``.
"""

from __future__ import annotations

import torch

#: The longest schedule served: each step is a forward of every guidance branch, so a count
#: past this holds the engine for minutes and is a mistake rather than a request.
MAX_STEPS = 1000


def timesteps(steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` times from 1 to 0, shifted towards 1 (more steps at high noise) as
    ``shift * t / (1 + (shift - 1) * t)``.

    Raises:
        ValueError: ``steps`` is not in ``1..MAX_STEPS`` or ``shift`` is not positive.
    """
    if not 1 <= steps <= MAX_STEPS or not shift > 0:
        raise ValueError(f"need 1 <= steps <= {MAX_STEPS} and shift > 0, got {steps} and {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def guided_velocity(
    cond: torch.Tensor,
    text_uncond: torch.Tensor,
    img_uncond: torch.Tensor,
    text_scale: float,
    img_scale: float,
    renorm_min: float,
) -> torch.Tensor:
    """BAGEL's two-stage guidance: text guidance against the prompt-free branch, then image
    guidance against the image-free branch, then a global renorm that keeps the guided
    velocity's norm at most the conditional one's (and at least ``renorm_min`` of it)."""
    v = text_uncond + text_scale * (cond - text_uncond)
    if img_scale != 1.0:
        v = img_uncond + img_scale * (v - img_uncond)
    if renorm_min < 1.0:
        scale = (cond.norm() / v.norm().clamp_min(1e-12)).clamp(min=renorm_min, max=1.0)
        v = v * scale
    return v


def guide(
    latent: torch.Tensor,
    cond_v: torch.Tensor,
    text_v: torch.Tensor,
    img_v: torch.Tensor,
    i: torch.Tensor,
    schedule: torch.Tensor,
    cfg: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One guided Euler step for a batch of requests (stacked along dim 0).

    ``i`` is each request's step index, ``schedule`` its ``timesteps``, ``cfg`` its
    ``(text_scale, img_scale, renorm_min)``. Returns the new latent, the next step index and the
    time the next step runs at.
    """
    latents, ts = [], []
    for b in range(latent.shape[0]):
        k = int(i[b])
        v = guided_velocity(
            cond_v[b], text_v[b], img_v[b], float(cfg[b, 0]), float(cfg[b, 1]), float(cfg[b, 2])
        )
        dt = schedule[b][k] - schedule[b][k + 1]
        latents.append(latent[b] - v * dt)
        ts.append(schedule[b][k + 1])
    return {"latent": torch.stack(latents), "i": i + 1, "t": torch.stack(ts)}
