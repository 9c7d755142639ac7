"""The uncached reference: the whole prefix + action sequence through both stacks at every step.

This is how upstream writes the joint forward without a cache: in every layer the prefix
tokens go through the LM's weights and the action tokens through the expert's, their queries,
keys and values are concatenated, and one attention runs over the joint sequence with the
pi0 block mask (the prefix sees only itself, bidirectionally; the actions see everything).
It recomputes the prefix at each of the flow's steps, so it is slow; tests check the cached,
batched engine against it.
"""

from __future__ import annotations

import torch

from mstar_async.models.pi05.gemma import DecoderLayer, Pi05Policy, attend


def joint_velocity(
    policy: Pi05Policy, prefix: torch.Tensor, actions: torch.Tensor, time: torch.Tensor
) -> torch.Tensor:
    """Velocity [horizon, action_dim] for one request's ``prefix`` embeddings [length, width],
    noisy ``actions`` [horizon, action_dim] and a 0-dim ``time``."""
    lm, expert = policy.lm, policy.expert
    length, horizon = prefix.shape[0], actions.shape[0]
    total = length + horizon
    positions = torch.arange(total).unsqueeze(0)
    mask = torch.ones(total, total, dtype=torch.bool)
    mask[:length, length:] = False
    mask = mask.view(1, 1, total, total)
    cond = expert.condition(time.reshape(1))
    xp, xs = prefix.unsqueeze(0), expert.action_in_proj(actions.unsqueeze(0))
    for lm_layer, ex_layer in zip(lm.layers, expert.layers, strict=True):
        assert isinstance(lm_layer, DecoderLayer) and isinstance(ex_layer, DecoderLayer)
        np_, _ = lm_layer.input_layernorm(xp)
        ns, gate = ex_layer.input_layernorm(xs, cond)
        qp, kp, vp = lm_layer.self_attn.project(np_, positions[:, :length])
        qs, ks, vs = ex_layer.self_attn.project(ns, positions[:, length:])
        q, k, v = (torch.cat(pair, dim=2) for pair in ((qp, qs), (kp, ks), (vp, vs)))
        attended = attend(q, k, v, mask)
        xp = lm_layer.add_mlp(lm_layer.add_attention(xp, attended[:, :, :length], None), None)
        xs = ex_layer.add_mlp(ex_layer.add_attention(xs, attended[:, :, length:], gate), cond)
    normed, _ = expert.norm(xs, cond)
    out: torch.Tensor = expert.action_out_proj(normed)[0]
    return out


def reference_actions(
    policy: Pi05Policy, prefix: torch.Tensor, noise: torch.Tensor, steps: int
) -> torch.Tensor:
    """The action chunk after ``steps`` Euler steps from ``noise`` at time 1 to time 0."""
    dt = torch.tensor(-1.0 / steps)
    actions, time = noise, torch.tensor(1.0)
    with torch.inference_mode():
        for _ in range(steps):
            actions = actions + dt * joint_velocity(policy, prefix, actions, time)
            time = time + dt
    return actions
