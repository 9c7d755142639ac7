"""The V-JEPA 2-AC components as engines: the encoder (stateless) and the cached predictor.

The predictor's two ops, as a ``FrameModel`` of ``BlockCausalKVEngine``:

- ``prefill``: ``latents`` ``[T, patches, dim]`` of the context frames, ``context_actions``
  ``[T - 1, 7]`` (the actions between them), ``states`` ``[T, 7]``, ``actions`` ``[H, 7]``
  (the plan; ``actions[0]`` is taken at the last context frame) -> ``latent`` (the predicted
  next frame, ``[patches, dim]``), ``state`` (the state it is predicted in) and ``index`` (1:
  how many frames the plan has predicted).
- ``step``: ``latent``, ``state``, ``index`` (from the previous prediction), ``actions`` ->
  the same three for the next frame, appending one frame (``actions[index]``) to the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mstar_async.engines import StatelessEngine, Step
from mstar_async.engines.block_causal import BlockCausalKVEngine, LayerAttention
from mstar_async.engines.kv import AttentionSpec
from mstar_async.errors import EngineError
from mstar_async.models.vjepa2.checkpoint import load_upstream
from mstar_async.models.vjepa2.config import VJEPA2Config
from mstar_async.models.vjepa2.modules import ACPredictor, VisionEncoder
from mstar_async.models.vjepa2.pose import next_state


def seeded(cfg: VJEPA2Config) -> tuple[VisionEncoder, ACPredictor]:
    """The encoder and predictor with weights drawn from ``cfg.seed`` (eval mode)."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        encoder = VisionEncoder(cfg).eval().requires_grad_(False)
        predictor = ACPredictor(cfg).eval().requires_grad_(False)
    return encoder, predictor


def networks(cfg: VJEPA2Config) -> tuple[VisionEncoder, ACPredictor]:
    """The seeded networks, with ``cfg.checkpoint``'s weights loaded over them when set.

    Raises:
        CheckpointError: the checkpoint cannot be read or does not match ``cfg``.
    """
    encoder, predictor = seeded(cfg)
    if cfg.checkpoint is not None:
        load_upstream(cfg.checkpoint, encoder, predictor)
    return encoder, predictor


def _tensor(step: Step, name: str, dims: int) -> torch.Tensor:
    value = step.inputs.get(name)
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        shape = None if not isinstance(value, torch.Tensor) else tuple(value.shape)
        raise EngineError(
            f"request {step.request_id}: op {step.op!r} needs {name!r} as a {dims}-d tensor, "
            f"got {type(value).__name__} {shape}"
        )
    return value.float()


class ACPredictorFrames:
    """``ACPredictor`` as a ``FrameModel``: turns prefill/step inputs into frames of tokens."""

    def __init__(self, predictor: ACPredictor) -> None:
        self.predictor = predictor
        self.cfg = predictor.cfg
        self.tokens_per_frame = self.cfg.tokens_per_frame

    def new_frames(self, step: Step) -> int:
        """Context frames for ``prefill``, one for ``step``."""
        latents = step.inputs.get("latents")
        if step.op == "prefill" and isinstance(latents, torch.Tensor) and latents.dim() == 3:
            return int(latents.shape[0])
        return 1

    def embed(self, step: Step, frames_held: int) -> torch.Tensor:
        """The tokens of the frames ``step`` appends.

        Raises:
            EngineError: an unknown op, a step before the prefill, a second prefill, inputs of
                the wrong shape, or a plan with no action left for this step.
        """
        if step.op == "prefill":
            latents, actions, states = self._prefill_frames(step, frames_held)
        elif step.op == "step":
            latents, actions, states = self._step_frame(step, frames_held)
        else:
            raise EngineError(f"the vjepa2 predictor has no op {step.op!r}; ops: prefill, step")
        want = (self.cfg.patches_per_frame, self.cfg.encoder_dim)
        if tuple(latents.shape[1:]) != want:
            raise EngineError(
                f"request {step.request_id}: latents must be [frames, {want[0]}, {want[1]}], "
                f"got {tuple(latents.shape)}"
            )
        return self.predictor.tokens(latents, actions, states)

    def _prefill_frames(
        self, step: Step, frames_held: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if frames_held:
            raise EngineError(f"request {step.request_id}: prefill twice; one per request")
        latents = _tensor(step, "latents", 3)
        context = _tensor(step, "context_actions", 2)
        states = _tensor(step, "states", 2)
        plan = self._plan(step, 0)
        t = latents.shape[0]
        if context.shape[0] != t - 1 or states.shape[0] != t:
            raise EngineError(
                f"request {step.request_id}: {t} context frames need {t - 1} context_actions "
                f"and {t} states, got {context.shape[0]} and {states.shape[0]}"
            )
        return latents, torch.cat([context, plan[:1]]), states

    def _step_frame(
        self, step: Step, frames_held: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not frames_held:
            raise EngineError(f"request {step.request_id}: step before prefill; prefill first")
        index = int(step.inputs["index"])
        plan = self._plan(step, index)
        latent = _tensor(step, "latent", 2)
        state = _tensor(step, "state", 1)
        return latent.unsqueeze(0), plan[index : index + 1], state.unsqueeze(0)

    def _plan(self, step: Step, index: int) -> torch.Tensor:
        plan = _tensor(step, "actions", 2)
        if plan.shape[-1] != self.cfg.action_dim or not 0 <= index < plan.shape[0]:
            raise EngineError(
                f"request {step.request_id}: the plan has shape {tuple(plan.shape)}; step "
                f"{index} needs an action there (actions are [horizon, {self.cfg.action_dim}])"
            )
        return plan

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        """The predictor's blocks over flat tokens."""
        hidden: torch.Tensor = self.predictor(x, positions, attention)
        return hidden

    def finish(self, steps: Sequence[Step], last_frames: torch.Tensor) -> list[dict[str, Any]]:
        """Predicted latents, the states they are predicted in, and the next plan index."""
        latents = self.predictor.head(last_frames[:, self.cfg.cond_tokens :])
        outputs = []
        for step, latent in zip(steps, latents, strict=True):
            index = int(step.inputs.get("index", 0))
            plan = step.inputs["actions"].float()
            if step.op == "prefill":
                state = step.inputs["states"][-1].float()
            else:
                state = step.inputs["state"].float()
            outputs.append(
                {
                    "latent": latent,
                    "state": next_state(state, plan[index]),
                    "index": torch.tensor(index + 1),
                }
            )
        return outputs


def predictor_engine(cfg: VJEPA2Config) -> BlockCausalKVEngine:
    """The seeded predictor on a block-causal KV cache of ``cfg.kv_frames`` frames (fp32)."""
    _, predictor = networks(cfg)
    spec = AttentionSpec(
        cfg.predictor_heads, cfg.predictor_heads, predictor.head_dim, dtype=torch.float32
    )
    return BlockCausalKVEngine(
        ACPredictorFrames(predictor),
        spec,
        num_layers=cfg.predictor_depth,
        kv_frames=cfg.kv_frames,
    )


def encoder_engine(cfg: VJEPA2Config) -> StatelessEngine:
    """The seeded encoder; requests' videos batch when they have as many frames."""
    encoder, _ = networks(cfg)

    def encode(video: torch.Tensor | list[torch.Tensor]) -> dict[str, Any]:
        if isinstance(video, torch.Tensor):
            n, t = video.shape[:2]
            return {"latents": encoder(video.flatten(0, 1).float()).unflatten(0, (n, t))}
        return {"latents": [encoder(v.float()) for v in video]}

    return StatelessEngine({"encode": encode})
