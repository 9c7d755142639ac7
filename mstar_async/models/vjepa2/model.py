"""``vjepa2``: a V-JEPA 2-AC world model, rolled out with a KV-cached predictor.

Two walks. ``context`` encodes the context frames (ViT, each frame on its own) and prefills the
predictor with them and their actions and states, which predicts the first frame of the plan.
``rollout`` is a ``DynamicLoop`` of predictor steps, each appending one predicted frame (its
action and state tokens and its latent) to the request's KV cache and predicting the next;
the loop ends when the request's ``horizon`` is reached. Every prediction streams to the
client as a ``LatentOutput`` while the loop runs.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import torch

from mstar_async.graph import DynamicLoop, Edge, LoopStep, Model, Node, Sequential, Walk
from mstar_async.models.registry import register
from mstar_async.models.vjepa2.config import VJEPA2Config, make_config
from mstar_async.models.vjepa2.engines import encoder_engine, predictor_engine
from mstar_async.models.vjepa2.rollout import RolloutInputs, random_inputs
from mstar_async.outputs import LatentOutput


def _reached_horizon(step: LoopStep) -> bool:
    return int(step.outputs["step.index"]) >= int(step.params["horizon"])


def request_inputs(
    cfg: VJEPA2Config,
    horizon: int,
    seed: int,
    video: torch.Tensor | None,
    actions: torch.Tensor | None,
    context_actions: torch.Tensor | None,
    states: torch.Tensor | None,
) -> RolloutInputs:
    """A request's rollout inputs: what it gave, seeded random values for the rest.

    Raises:
        ValueError: ``horizon`` is not in ``1..max_horizon``, or a given tensor has the wrong
            shape (the message names it and the shape wanted).
    """
    if isinstance(horizon, bool) or not isinstance(horizon, int):
        raise ValueError(f"horizon must be an int, got {horizon!r}")
    if not 1 <= horizon <= cfg.max_horizon:
        raise ValueError(f"horizon must be in 1..{cfg.max_horizon}, got {horizon}")
    frames = cfg.context_frames if video is None else int(video.shape[0])
    drawn = random_inputs(cfg, horizon, seed, context_frames=max(1, frames))
    chosen = RolloutInputs(
        video=drawn.video if video is None else video,
        context_actions=drawn.context_actions if context_actions is None else context_actions,
        states=drawn.states if states is None else states,
        actions=drawn.actions if actions is None else actions,
    )
    size, a = cfg.image_size, cfg.action_dim
    wanted = {
        "video": (frames, cfg.in_chans, size, size),
        "context_actions": (frames - 1, a),
        "states": (frames, a),
        "actions": (horizon, a),
    }
    for name, shape in wanted.items():
        value = getattr(chosen, name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or frames < 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {got}")
    return chosen


def _program(cfg: VJEPA2Config) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        horizon: int = 8,
        seed: int = 0,
        video: torch.Tensor | None = None,
        actions: torch.Tensor | None = None,
        context_actions: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> AsyncGenerator[Any, None]:
        inputs = request_inputs(cfg, horizon, seed, video, actions, context_actions, states)
        first = await request.run(
            "context",
            video=inputs.video,
            context_actions=inputs.context_actions,
            states=inputs.states,
            actions=inputs.actions,
        )
        yield LatentOutput(first["latent"], 0)
        if horizon > 1:
            params = {"horizon": horizon}
            async with request.stream("rollout", params=params, actions=inputs.actions) as walk:
                async for event in walk:
                    yield LatentOutput(event.value, event.iteration + 1)

    return program


@register("vjepa2", "V-JEPA 2-AC world model: ViT encoder, then a KV-cached predictor rollout")
def build_vjepa2(size: str = "tiny", *, path: str | Path | None = None, **overrides: Any) -> Model:
    """Build the world model at ``size`` (``tiny``, ``small``, or upstream's ``vitg``);
    ``overrides`` set ``VJEPA2Config`` fields (``seed=1``, ``kv_frames=512``). ``path`` is an
    upstream checkpoint file whose weights replace the seeded ones (the ``checkpoint`` field;
    its size must match ``size``).

    Raises:
        ValueError: an unknown size or a bad override value.
        TypeError: an override names no ``VJEPA2Config`` field.
    """
    if path is not None:
        overrides["checkpoint"] = str(path)
    cfg = make_config(size, **overrides)
    frame_state = ["latent", "state", "index"]
    nodes = [
        Node("encode", engine="encoder", inputs=["video"], outputs=["latents"]),
        Node(
            "prefill",
            engine="predictor",
            inputs=["latents", "context_actions", "states", "actions"],
            outputs=frame_state,
        ),
        Node("step", engine="predictor", inputs=[*frame_state, "actions"], outputs=frame_state),
    ]
    rollout = DynamicLoop(
        "step",
        until=_reached_horizon,
        max_iterations=cfg.max_horizon,
        carry={f"step.{port}": f"step.{port}" for port in frame_state},
    )
    return Model(
        "vjepa2",
        nodes=nodes,
        edges=[
            Edge("encode.latents", "prefill.latents"),
            *(Edge(f"prefill.{port}", f"step.{port}") for port in frame_state),
        ],
        walks=[
            Walk("context", Sequential("encode", "prefill"), outputs=["prefill.latent"]),
            Walk("rollout", rollout, outputs=["step.latent"]),
        ],
        program=_program(cfg),
        components={
            "encoder": functools.partial(encoder_engine, cfg),
            "predictor": functools.partial(predictor_engine, cfg),
        },
        description=f"V-JEPA 2-AC ({size}): {cfg.patches_per_frame} latent tokens per frame",
    )
