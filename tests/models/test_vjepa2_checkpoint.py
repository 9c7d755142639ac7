"""Upstream-layout V-JEPA 2-AC checkpoints load by parameter name, or fail naming the mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mstar_async.models.checkpoints import CheckpointError
from mstar_async.models.vjepa2 import make_config, random_inputs, recompute_rollout
from mstar_async.models.vjepa2.engines import networks, seeded

pytestmark = pytest.mark.timeout(30)


def save_upstream_layout(path: Path, seed: int) -> None:
    """Seeded tiny weights saved as upstream's training wrappers name them."""
    encoder, predictor = seeded(make_config("tiny", seed=seed))
    state = {
        "encoder": {f"module.backbone.{k}": v for k, v in encoder.state_dict().items()},
        "predictor": {
            **{f"module.backbone.{k}": v for k, v in predictor.state_dict().items()},
            "module.backbone.extrinsics_encoder.weight": torch.zeros(48, 6),
            "module.backbone.extrinsics_encoder.bias": torch.zeros(48),
        },
        "epoch": 3,
    }
    torch.save(state, path)


def test_a_checkpoint_replaces_the_seeded_weights(tmp_path: Path) -> None:
    path = tmp_path / "ac.pt"
    save_upstream_layout(path, seed=5)
    loaded = networks(make_config("tiny", seed=0, checkpoint=str(path)))
    trained = seeded(make_config("tiny", seed=5))
    inputs = random_inputs(make_config("tiny"), 3, seed=1)
    got = recompute_rollout(*loaded, inputs)
    for a, b in zip(got, recompute_rollout(*trained, inputs), strict=True):
        assert torch.equal(a, b)
    unloaded = recompute_rollout(*seeded(make_config("tiny", seed=0)), inputs)
    assert not torch.allclose(got[0], unloaded[0], atol=1e-3)


def test_a_checkpoint_of_another_size_fails_naming_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ac.pt"
    save_upstream_layout(path, seed=5)
    with pytest.raises(
        CheckpointError, match=r"predictor does not match .*shape: \['action_encoder.bias'"
    ):
        networks(make_config("tiny", predictor_dim=64, checkpoint=str(path)))
    torch.save({"predictor": {}}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="expected 'encoder'"):
        networks(make_config("tiny", checkpoint=str(tmp_path / "bad.pt")))
    with pytest.raises(CheckpointError, match="cannot read"):
        networks(make_config("tiny", checkpoint=str(tmp_path / "absent.pt")))
