"""Loading qwen3-omni from a 256 MB checkpoint in the released layout, per rank: a rank's peak
memory stays near its own weights, it reads only its parts' tensors, and its parts live as long
as its engines."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from collections.abc import Iterator

import pytest
import torch
from safetensors import safe_open

from mstar_async.bench.load import measure_in_child
from mstar_async.bench.omni_folder import OmniFolder, write_omni_folder
from mstar_async.models import build_model
from mstar_async.models.checkpoints import read_config
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import OmniWeights

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc"),
]

MB = 2**20
EMBED = "thinker.model.embed_tokens.weight"
EVERY_PART = ("thinker.model.", "thinker.lm_head.", "talker.", "code2wav.")  # not the towers


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Copies on two threads of a shared 2-core machine spin-wait: one thread is steadier.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
        (["talker", "predictor"], ("talker.", EMBED)),
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


def test_a_talker_rank_reads_its_parts_and_only_the_thinkers_embedding(folder: OmniFolder) -> None:
    weights = _weights(folder)
    talker, predictor = weights.talker(), weights.code_predictor()
    embedding = weights.thinker_embedding()
    assert predictor is talker.code_predictor
    assert [part for part, _ in weights.loads] == ["talker", "thinker_embedding"]
    read = [name for _, stats in weights.loads for name in stats.names]
    assert sorted(read) == sorted([*(n for n in folder.sizes if n.startswith("talker.")), EMBED])
    assert sum(stats.bytes for _, stats in weights.loads) == folder.bytes_under("talker.", EMBED)
    assert torch.equal(embedding.weight, _stored(folder, EMBED))
    stack = talker.model.layers[1].mlp.experts.gate_up_proj
    assert stack.dtype == torch.bfloat16 and not stack.requires_grad
    half = stack.shape[1] // 2
    gate = _stored(folder, "talker.model.layers.1.mlp.experts.3.gate_proj.weight")
    up = _stored(folder, "talker.model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(stack[3, :half], gate) and torch.equal(stack[3, half:], up)


def test_a_part_is_shared_while_held_and_freed_with_its_holders(folder: OmniFolder) -> None:
    weights = _weights(folder)
    embedding = weights.thinker_embedding()
    thinker = weights.thinker()  # takes the live table: its tensor is not read again
    assert thinker.embed_tokens is embedding
    (_, table), (_, rest) = weights.loads
    assert table.names == (EMBED,) and EMBED not in rest.names
    assert weights.thinker_embedding() is embedding
    gone = weakref.ref(thinker)
    del thinker, embedding
    gc.collect()
    assert gone() is None
    weights.thinker_embedding()
    assert [part for part, _ in weights.loads] == [
        "thinker_embedding",
        "thinker",
        "thinker_embedding",
    ]


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
