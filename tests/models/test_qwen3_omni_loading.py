"""Loading qwen3-omni from a 256 MB checkpoint in the released layout, per rank: a rank's peak
memory stays near its own weights, it reads only its parts' tensors (a talker rank none of the
thinker's), and its parts live as long as its engines."""

from __future__ import annotations

import functools
import gc
import json
import sys
import weakref
from collections.abc import Iterator, Sequence

import pytest
import torch
from safetensors import safe_open

from mstar_async.bench.load import measure_in_child
from mstar_async.bench.omni_folder import OmniFolder, write_omni_folder
from mstar_async.models import build_model
from mstar_async.models.checkpoints import SafetensorsFolder, read_config
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import OmniWeights

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc"),
]

MB = 2**20
EVERY_PART = ("thinker.model.", "thinker.lm_head.", "talker.", "code2wav.")  # not the towers


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> OmniFolder:
    return write_omni_folder(tmp_path_factory.mktemp("omni") / "ckpt", 256 * MB)


def _weights(folder: OmniFolder) -> OmniWeights:
    cfg = OmniConfig.from_hf(read_config(folder.path))
    return OmniWeights(cfg, folder.path, torch.bfloat16, "cpu")


def _stored(folder: OmniFolder, name: str) -> torch.Tensor:
    index = json.loads((folder.path / "model.safetensors.index.json").read_text())
    with safe_open(folder.path / index["weight_map"][name], "pt") as f:
        return f.get_tensor(name).clone()


@pytest.mark.parametrize(
    ("engines", "prefixes"),
    [
        (["thinker", "talker", "predictor", "code2wav"], EVERY_PART),
        (["talker", "predictor"], ("talker.",)),
    ],
    ids=["every-engine", "talker-rank"],
)
def test_a_rank_peaks_within_its_own_weights(
    folder: OmniFolder, engines: list[str], prefixes: tuple[str, ...]
) -> None:
    measured = measure_in_child("engines", folder.path, engines)
    weights = folder.bytes_under(*prefixes)
    growth = measured["peak_rss"] - measured["baseline_rss"]
    bound = 1.3 * weights + 200 * MB
    print(f"{engines}: weights {weights / MB:.0f} MB, peak RSS +{growth / MB:.0f} MB")
    assert weights <= growth <= bound, (weights / MB, growth / MB)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes read from the checkpoint's files from now on, by tensor name."""
    read: dict[str, int] = {}
    original = SafetensorsFolder.read

    def recording(
        self: SafetensorsFolder, names: Sequence[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in original(self, names):
            read[name] = read.get(name, 0) + tensor.numel() * tensor.element_size()
            yield name, tensor

    monkeypatch.setattr(SafetensorsFolder, "read", recording)
    return read


def test_a_talker_rank_reads_its_parts_and_none_of_the_thinkers_tensors(
    folder: OmniFolder, reads: dict[str, int]
) -> None:
    model = build_model("qwen3-omni", path=folder.path, dtype="bfloat16", kv_cache_bytes=MB)
    engines = [model.components[name]() for name in ("talker", "predictor")]
    thinker_bytes = sum(n for name, n in reads.items() if name.startswith("thinker."))
    print(f"talker rank: {sum(reads.values()) / MB:.1f} MB read, {thinker_bytes} of the thinker")
    assert thinker_bytes == 0
    assert sorted(reads) == sorted(n for n in folder.sizes if n.startswith("talker."))
    assert sum(reads.values()) == folder.bytes_under("talker.")
    factory = model.components["talker"]
    assert isinstance(factory, functools.partial)
    weights: OmniWeights = factory.args[0]  # the model's parts
    talker = weights.talker()  # the engines' live talker: nothing is read again
    assert weights.code_predictor() is talker.code_predictor
    assert [part for part, _ in weights.loads] == ["talker"]
    stack = talker.model.layers[1].mlp.experts.gate_up_proj
    assert stack.dtype == torch.bfloat16 and not stack.requires_grad
    half = stack.shape[1] // 2
    gate = _stored(folder, "talker.model.layers.1.mlp.experts.3.gate_proj.weight")
    up = _stored(folder, "talker.model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(stack[3, :half], gate) and torch.equal(stack[3, half:], up)
    del engines


def test_a_part_is_shared_while_held_and_freed_with_its_holders(folder: OmniFolder) -> None:
    weights = _weights(folder)
    predictor = weights.code_predictor()
    talker = weights.talker()  # takes the live predictor: its tensors are not read again
    assert talker.code_predictor is predictor
    (_, alone), (_, rest) = weights.loads
    assert alone.names and all(n.startswith("talker.code_predictor.") for n in alone.names)
    assert not any(n.startswith("talker.code_predictor.") for n in rest.names)
    assert weights.code_predictor() is predictor
    gone = weakref.ref(talker)
    del talker, predictor
    gc.collect()
    assert gone() is None
    weights.code_predictor()
    assert [part for part, _ in weights.loads] == ["code_predictor", "talker", "code_predictor"]


def _thinkers() -> int:
    gc.collect()
    return sum(type(o) is Thinker for o in gc.get_objects())


def test_the_engines_of_a_rank_without_the_thinker_build_no_thinker(folder: OmniFolder) -> None:
    before = _thinkers()
    model = build_model("qwen3-omni", path=folder.path, dtype="bfloat16", kv_cache_bytes=MB)
    engines = [model.components[name]() for name in ("talker", "predictor", "code2wav")]
    assert _thinkers() == before
    thinker = model.components["thinker"]()
    assert _thinkers() == before + 1
    del engines, thinker
