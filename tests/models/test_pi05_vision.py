"""pi05's image encoder: EfficientNet-Lite0 with the shipped weights, checked against the
reference implementation those weights were published for (``efficientnet-lite-pytorch``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from efficientnet_lite_pytorch import EfficientNet

from mstar_async.models.pi05.config import SMALL, TINY, Pi05Config
from mstar_async.models.pi05.model import build_vision
from mstar_async.models.pi05.vision import EfficientNetLite0, lite0_weights_path

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Depthwise convolutions stall in OpenMP barriers when the cores are oversubscribed (the
    # whole suite on 2 cores); one thread runs these small images in tens of milliseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_model() -> torch.nn.Module:
    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=str(lite0_weights_path())
    )
    return model.eval()


@pytest.mark.parametrize("side", [64, 96])
def test_features_match_the_reference_model_on_the_shipped_weights(side: int) -> None:
    images = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(side))
    ours = EfficientNetLite0.pretrained()
    with torch.inference_mode():
        got = ours(images)
        want = reference_model().extract_features(images)
    assert got.shape == (1, 1280, -(-side // 32), -(-side // 32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(got.abs().max()) > 1.0  # real activations, not an all-zero map


def test_every_shipped_weight_is_loaded() -> None:
    shipped = torch.load(lite0_weights_path(), map_location="cpu", weights_only=True)
    ours = EfficientNetLite0.pretrained().state_dict()
    assert set(ours) == {k for k in shipped if not k.startswith("_fc.")}
    for name, tensor in ours.items():
        assert torch.equal(tensor, shipped[name]), name


@pytest.mark.parametrize("cfg", [TINY, replace(SMALL, image_size=96)], ids=["tiny", "small"])
def test_encoder_projects_one_token_per_feature_cell_into_the_lm_width(cfg: Pi05Config) -> None:
    encoder = build_vision(cfg)
    side = cfg.image_size
    image = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        tokens = encoder(image)["tokens"]
        features = reference_model().extract_features(image * (255 / 128) - 127 / 128)
        expected = encoder.img_proj(features.flatten(2).transpose(1, 2))
    cells = (side // 32) ** 2
    assert tokens.shape == (1, cells, cfg.lm.width)
    torch.testing.assert_close(tokens, expected, atol=1e-5, rtol=0)
