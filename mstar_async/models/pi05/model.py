"""``pi05``: a pi0.5-style vision-language-action policy with a cached prefix and batched
flow-matching steps.

Two walks. ``prefix`` encodes the camera image (EfficientNet-Lite0 with real weights, then a
projection) and runs the prefix LM over image tokens, instruction and discretised state; the
policy engine keeps that prefix's per-layer keys and values for the request. ``act`` is a
``Loop`` of ``steps`` flow-matching steps (10 by default): the action expert turns the noisy
action chunk and the time into a velocity, attending to the cached prefix, and an Euler update
moves the chunk from noise (time 1) towards actions (time 0). Expert steps of many requests run
as one batched forward, whatever their prefix lengths. The program yields one ``ActionOutput``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mstar_async.engines import StatelessEngine
from mstar_async.engines.prefix_cache import (
    PREFIX_OP,
    PaddedPrefixes,
    PrefixCacheEngine,
    PrefixKV,
)
from mstar_async.graph import Edge, Loop, Model, Node, Sequential, Walk
from mstar_async.models.pi05.config import Pi05Config, make_config
from mstar_async.models.pi05.gemma import Pi05Policy, right_pad
from mstar_async.models.pi05.prompt import tokenize
from mstar_async.models.pi05.vision import VisionEncoder
from mstar_async.models.registry import register
from mstar_async.outputs import ActionOutput


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module under ``seed`` without touching the global generator; eval mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().eval()


def build_policy(cfg: Pi05Config) -> Pi05Policy:
    """The prefix LM and action expert with the seeded weights of ``cfg``."""
    policy = seeded(cfg.seed, lambda: Pi05Policy(cfg))
    assert isinstance(policy, Pi05Policy)
    return policy


def build_vision(cfg: Pi05Config) -> VisionEncoder:
    """EfficientNet-Lite0 (real weights) with a projection seeded from ``cfg.seed + 1``.

    Raises:
        CheckpointError: the weights package is not installed.
    """
    encoder = seeded(cfg.seed + 1, lambda: VisionEncoder(cfg.lm.width))
    assert isinstance(encoder, VisionEncoder)
    return encoder


class PolicyCache:
    """The policy as the ``PrefixCacheEngine`` drives it: prefixes in, velocities out."""

    suffix_ops = frozenset({"velocity"})

    def __init__(self, policy: Pi05Policy) -> None:
        self.policy = policy

    @property
    def device(self) -> torch.device:
        """Where the policy's weights live."""
        return self.policy.lm.embed_tokens.weight.device

    def step_tokens(self, op: str, inputs: Mapping[str, Any]) -> int:
        """A prefix's image and text tokens; 1 for a velocity step.

        Why 1: a velocity step is the action loop's decode, one short expert pass per request;
        counted by its action tokens, a budget would split the loop's batch over forwards
        (16 requests of 50 actions are 800 tokens), and batching them all is the point.
        """
        if op == PREFIX_OP:
            return int(inputs["image_tokens"].shape[0]) + int(inputs["tokens"].shape[0])
        return 1

    def encode_prefix(self, batch: Sequence[Mapping[str, Any]]) -> list[PrefixKV]:
        """Per-layer keys and values of each step's ``image_tokens`` + ``tokens`` prefix."""
        device = self.device
        embeds = [
            self.policy.prefix_embeds(s["image_tokens"].to(device), s["tokens"].to(device))
            for s in batch
        ]
        padded, lengths = right_pad(embeds)
        layers = self.policy.lm.layer_kv(padded, lengths)
        prefixes = []
        for i, length in enumerate(lengths.tolist()):
            # Copies, so a long neighbour's padding is not kept alive with this request.
            keys = tuple(k[i, :, :length].clone() for k, _ in layers)
            values = tuple(v[i, :, :length].clone() for _, v in layers)
            prefixes.append(PrefixKV(keys, values))
        return prefixes

    def run_suffix(
        self, op: str, batch: Sequence[Mapping[str, Any]], prefixes: PaddedPrefixes
    ) -> list[dict[str, Any]]:
        """Velocities of each step's noisy ``actions`` at its ``time``."""
        weight = self.policy.expert.action_in_proj.weight
        actions = torch.stack([torch.as_tensor(s["actions"]) for s in batch])
        time = torch.stack([torch.as_tensor(s["time"]).reshape(()) for s in batch])
        actions = actions.to(device=weight.device, dtype=weight.dtype)
        time = time.to(device=weight.device, dtype=weight.dtype)
        layers = list(zip(prefixes.keys, prefixes.values, strict=True))
        velocity = self.policy.expert.velocity(actions, time, layers, prefixes.lengths)
        return [{"velocity": v} for v in velocity]


def euler(
    actions: torch.Tensor, velocity: torch.Tensor, time: torch.Tensor, dt: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One Euler step of the flow, batched: ``actions += dt * velocity``, ``time += dt``."""
    step = dt.view(-1, *([1] * (actions.dim() - 1)))
    return {"actions": actions + step * velocity, "time": time + dt}


def synthetic_image(cfg: Pi05Config, seed: int) -> torch.Tensor:
    """A seeded camera image [3, size, size] in [0, 1]: smooth colour gradients plus noise."""
    gen = torch.Generator().manual_seed(seed)
    side = torch.linspace(0.0, 1.0, cfg.image_size)
    ramp = (side.view(1, -1, 1) + side.view(1, 1, -1)) / 2
    tint = torch.rand(3, 1, 1, generator=gen)
    noise = torch.rand(3, cfg.image_size, cfg.image_size, generator=gen)
    return (0.6 * ramp * tint + 0.4 * noise).clamp(0.0, 1.0)


def synthetic_state(cfg: Pi05Config, seed: int) -> torch.Tensor:
    """A seeded normalised robot state in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.rand(cfg.state_dim, generator=gen) * 2 - 1


def initial_noise(cfg: Pi05Config, seed: int) -> torch.Tensor:
    """The action chunk at time 1: standard normal noise [horizon, action_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.action_horizon, cfg.action_dim, generator=gen)


def _check_image(image: Any) -> torch.Tensor:
    if (
        not isinstance(image, torch.Tensor)
        or image.dim() != 3
        or image.shape[0] != 3
        or min(image.shape[1:]) < 32
    ):
        raise ValueError(
            f"pi05: image must be a [3, height, width] tensor in [0, 1] with sides >= 32, "
            f"got {tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__}"
        )
    return image.to(torch.float32)


def _program(cfg: Pi05Config) -> Callable[..., AsyncGenerator[Any, None]]:
    async def program(
        request: Any,
        instruction: str = "pick up the red block and put it in the bowl",
        image: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        steps: int = 10,
        seed: int = 0,
    ) -> AsyncGenerator[Any, None]:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"pi05: steps must be an int >= 1, got {steps!r}")
        pixels = _check_image(image if image is not None else synthetic_image(cfg, seed))
        robot = state if state is not None else synthetic_state(cfg, seed)
        await request.run("prefix", image=pixels, tokens=tokenize(instruction, robot, cfg))
        result = await request.run(
            "act",
            params={"steps": steps},
            actions=initial_noise(cfg, seed),
            time=torch.tensor(1.0),
            dt=torch.tensor(-1.0 / steps),
        )
        yield ActionOutput(result["actions"].cpu())

    return program


def _policy_engine(cfg: Pi05Config, max_requests: int | None, device: str) -> PrefixCacheEngine:
    policy = build_policy(cfg).to(device)
    return PrefixCacheEngine(PolicyCache(policy), max_requests=max_requests)


def _vision_engine(cfg: Pi05Config, device: str) -> StatelessEngine:
    return StatelessEngine({"encode": build_vision(cfg).to(device)}, device=device)


def _euler_engine(device: str) -> StatelessEngine:
    return StatelessEngine({"step": euler}, device=device)


@register("pi05", "pi0.5-style VLA: EfficientNet + prefix LM, cached prefix, flow-matching actions")
def build_pi05(
    size: str = "tiny",
    *,
    max_requests: int | None = None,
    device: str = "cpu",
    **overrides: Any,
) -> Model:
    """Build the policy at ``size`` (``tiny`` or ``small``) in fp32 on ``device``; ``overrides``
    set ``Pi05Config`` fields (e.g. ``seed=1``); ``max_requests`` bounds the prefixes the
    policy engine holds. A request's bad input (image, state, steps) is a ``ValueError``;
    ``info["image_inputs"]`` names the input that takes an image.

    Raises:
        MstarError: an unknown size or field, or stacks that cannot attend to each other.
    """
    cfg = make_config(size, **overrides)
    nodes = [
        Node("vision", engine="vision", op="encode", inputs=["image"], outputs=["tokens"]),
        Node("prefix", engine="policy", inputs=["image_tokens", "tokens"], outputs=["length"]),
        Node(
            "expert",
            engine="policy",
            op="velocity",
            inputs=["actions", "time"],
            outputs=["velocity"],
        ),
        Node(
            "euler",
            engine="euler",
            op="step",
            inputs=["actions", "velocity", "time", "dt"],
            outputs=["actions", "time"],
        ),
    ]
    flow = Loop(
        Sequential("expert", "euler"),
        iterations="steps",
        carry={
            "euler.actions": ["expert.actions", "euler.actions"],
            "euler.time": ["expert.time", "euler.time"],
        },
    )
    return Model(
        "pi05",
        nodes=nodes,
        edges=[
            Edge("vision.tokens", "prefix.image_tokens"),
            Edge("expert.velocity", "euler.velocity"),
        ],
        walks=[
            Walk("prefix", Sequential("vision", "prefix"), outputs=["prefix.length"]),
            Walk("act", flow, outputs=["euler.actions"]),
        ],
        program=_program(cfg),
        components={
            "vision": functools.partial(_vision_engine, cfg, device),
            "policy": functools.partial(_policy_engine, cfg, max_requests, device),
            "euler": functools.partial(_euler_engine, device),
        },
        description=f"pi0.5-style policy ({size}): {cfg.action_horizon}x{cfg.action_dim} chunks",
        info={"image_inputs": ["image"]},
    )
