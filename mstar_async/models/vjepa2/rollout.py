"""A rollout's inputs, and the reference rollout that re-runs the predictor every step.

The reference (upstream's planning loop) has no cache: to predict frame ``t + 1`` it runs the
predictor over all ``t + 1`` frames so far, keeps the last frame's prediction, appends it and
goes again, so step ``t`` costs ``t`` frames of compute. The served model computes the same
predictions with one new frame per step; the tests hold the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar_async.models.vjepa2.config import VJEPA2Config
from mstar_async.models.vjepa2.modules import ACPredictor, VisionEncoder
from mstar_async.models.vjepa2.pose import next_state


@dataclass(frozen=True)
class RolloutInputs:
    """What one rollout starts from: context frames ``[T, 3, size, size]``, the actions between
    them ``[T - 1, 7]``, their states ``[T, 7]`` and the plan ``[horizon, 7]``."""

    video: torch.Tensor
    context_actions: torch.Tensor
    states: torch.Tensor
    actions: torch.Tensor

    @property
    def horizon(self) -> int:
        """Frames the plan predicts."""
        return int(self.actions.shape[0])


def random_inputs(
    cfg: VJEPA2Config, horizon: int, seed: int, context_frames: int | None = None
) -> RolloutInputs:
    """Seeded random inputs: a video in [0, 1], small motions, a half-open gripper.

    Raises:
        ValueError: ``horizon`` or ``context_frames`` is below 1.
    """
    frames = cfg.context_frames if context_frames is None else context_frames
    if horizon < 1 or frames < 1:
        raise ValueError(f"horizon and context frames must be >= 1, got {horizon} and {frames}")
    gen = torch.Generator().manual_seed(seed)
    size = cfg.image_size
    video = torch.rand(frames, cfg.in_chans, size, size, generator=gen)
    moves = 0.05 * torch.randn(frames - 1 + horizon, cfg.action_dim, generator=gen)
    start = torch.cat([0.1 * torch.randn(6, generator=gen), torch.tensor([0.5])])
    states = [start]
    for move in moves[: frames - 1]:
        states.append(next_state(states[-1], move))
    return RolloutInputs(video, moves[: frames - 1], torch.stack(states), moves[frames - 1 :])


def recompute_rollout(
    encoder: VisionEncoder, predictor: ACPredictor, inputs: RolloutInputs
) -> list[torch.Tensor]:
    """The predicted latents ``[patches, dim]`` of every plan step, re-running the predictor
    over the whole growing context at each step (no cache)."""
    with torch.inference_mode():
        latents = encoder(inputs.video.float())
        actions = torch.cat([inputs.context_actions, inputs.actions[:1]]).float()
        states = inputs.states.float()
        predictions: list[torch.Tensor] = []
        for step in range(inputs.horizon):
            predicted = predictor.predict_all(latents, actions, states)[-1]
            predictions.append(predicted)
            if step + 1 == inputs.horizon:
                break
            latents = torch.cat([latents, predicted.unsqueeze(0)])
            states = torch.cat([states, next_state(states[-1], actions[-1]).unsqueeze(0)])
            actions = torch.cat([actions, inputs.actions[step + 1 : step + 2].float()])
    return predictions
