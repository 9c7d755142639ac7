"""End-effector state after an action, as upstream's planner integrates it between steps.

A state and an action are 7 numbers: position xyz, extrinsic xyz Euler angles, gripper. The
next position adds the action's; the next orientation is the action's rotation applied after
the current one; the next gripper adds the action's and stays within [0, 1].
"""

from __future__ import annotations

import torch


def euler_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """Rotation matrices ``[..., 3, 3]`` of extrinsic xyz Euler angles ``[..., 3]``."""
    cx, cy, cz = angles.cos().unbind(-1)
    sx, sy, sz = angles.sin().unbind(-1)
    one, zero = torch.ones_like(cx), torch.zeros_like(cx)
    rx = torch.stack([one, zero, zero, zero, cx, -sx, zero, sx, cx], -1).view(*cx.shape, 3, 3)
    ry = torch.stack([cy, zero, sy, zero, one, zero, -sy, zero, cy], -1).view(*cx.shape, 3, 3)
    rz = torch.stack([cz, -sz, zero, sz, cz, zero, zero, zero, one], -1).view(*cx.shape, 3, 3)
    rotation: torch.Tensor = rz @ ry @ rx
    return rotation


def matrix_to_euler(matrix: torch.Tensor) -> torch.Tensor:
    """Extrinsic xyz Euler angles ``[..., 3]`` of rotation matrices (pitch in [-pi/2, pi/2])."""
    pitch = torch.asin((-matrix[..., 2, 0]).clamp(-1.0, 1.0))
    roll = torch.atan2(matrix[..., 2, 1], matrix[..., 2, 2])
    yaw = torch.atan2(matrix[..., 1, 0], matrix[..., 0, 0])
    return torch.stack([roll, pitch, yaw], dim=-1)


def next_state(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """The state ``[..., 7]`` reached from ``state`` by ``action`` (same shape).

    Raises:
        ValueError: the last dimension is not 7.
    """
    if state.shape[-1] != 7 or action.shape[-1] != 7:
        raise ValueError(
            f"states and actions are 7 numbers (xyz, euler xyz, gripper); got "
            f"{tuple(state.shape)} and {tuple(action.shape)}"
        )
    xyz = state[..., :3] + action[..., :3]
    rotation = euler_to_matrix(action[..., 3:6]) @ euler_to_matrix(state[..., 3:6])
    gripper = (state[..., 6:] + action[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, matrix_to_euler(rotation), gripper], dim=-1)
