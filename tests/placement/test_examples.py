"""The shipped placements in examples/placements/, each against the model it is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar_async.errors import PlacementError
from mstar_async.graph import Model
from mstar_async.placement import Migration, Placement
from tests.placement.models import causal_lm, demo

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placements"


@pytest.fixture(scope="module")
def demo_model() -> Model:
    return demo()


@pytest.fixture(scope="module")
def lm_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return causal_lm(tmp_path_factory.mktemp("tiny-tokenizer"))


def load(name: str) -> Placement:
    return Placement.from_yaml(EXAMPLES / name)


@pytest.mark.parametrize(
    "name",
    [
        "single.yaml",
        "codec_split.yaml",
        "prefill_decode.yaml",
        "replicas.yaml",
        "orpheus_codec_split.yaml",
    ],
)
def test_each_example_round_trips(name: str) -> None:
    p = load(name)
    assert Placement.from_dict(p.to_dict()) == p


def test_single(demo_model: Model, lm_model: Model) -> None:
    r = load("single.yaml").validate(demo_model)
    assert r.engines == {0: {"lm", "codec", "denoiser", "cfg", "vae"}}
    assert all(ranks == (0,) for nodes in r.walks.values() for ranks in nodes.values())
    r = load("single.yaml").validate(lm_model)
    assert r.walks == {"prefill": {"prefill": (0,)}, "decode": {"decode": (0,)}}
    assert r.engines == {0: {"lm"}}
    assert r.migrations == ()


def test_codec_split(demo_model: Model) -> None:
    r = load("codec_split.yaml").validate(demo_model)
    assert r.walks == {
        "prefill": {"prefill": (0,)},
        "speak": {"step": (0,), "codec": (1,)},
        "image": {"cond": (0,), "uncond": (0,), "guide": (0,), "vae": (0,)},
    }
    assert r.engines == {0: {"lm", "denoiser", "cfg", "vae"}, 1: {"codec"}}
    assert (dict(r.devices), r.migrations, r.link(0, 1)) == ({0: "cpu", 1: "cpu"}, (), "ipc")


def test_prefill_decode(lm_model: Model, demo_model: Model) -> None:
    p = load("prefill_decode.yaml")
    r = p.validate(lm_model)
    assert r.walks == {"prefill": {"prefill": (0,)}, "decode": {"decode": (1,)}}
    assert r.engines == {0: {"lm"}, 1: {"lm"}}
    assert r.migrations == (Migration("lm", "prefill", "decode", (0,), (1,)),)
    assert p.migrations(lm_model) == list(r.migrations)
    with pytest.raises(PlacementError, match="written for model 'causal-lm'"):
        p.validate(demo_model)


def test_replicas(demo_model: Model) -> None:
    r = load("replicas.yaml").validate(demo_model)
    assert r.walks["speak"] == {"step": (0,), "codec": (1, 2)}
    assert r.walks["prefill"] == {"prefill": (0,)}
    assert r.engines == {0: {"lm", "denoiser", "cfg", "vae"}, 1: {"codec"}, 2: {"codec"}}
    assert (r.migrations, len(r.devices)) == ((), 3)
