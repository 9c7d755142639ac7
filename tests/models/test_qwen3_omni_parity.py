"""qwen3-omni parts against transformers' ``qwen3_omni_moe`` modules on tiny random configs.

Upstream modules are built from tiny configs with random weights; their state dicts load into
ours by upstream names (strictly), and both run the same inputs in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mstar_async.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, Qwen3Config, seeded_init
from mstar_async.models.qwen3_omni.talker import Talker
from mstar_async.models.qwen3_omni.thinker import Thinker
from mstar_async.models.qwen3_omni.weights import fuse_expert_keys, load_part, upstream_keys

hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
hf_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

pytestmark = pytest.mark.timeout(60)

TOL = {"atol": 1e-4, "rtol": 1e-4}

TEXT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.5 if param.dim() > 1 else 0.1
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
            if name.endswith("norm.weight"):
                param.add_(1.0)


def test_thinker_text_model_logits_match_upstream() -> None:
    upstream = hf.Qwen3OmniMoeThinkerTextModel(hf_config.Qwen3OmniMoeTextConfig(**TEXT)).eval()
    _randomise(upstream, 0)
    cfg = Qwen3Config.from_hf(TEXT)
    assert cfg.sparse(0) and cfg.sparse(1)
    ours = Thinker(cfg, TEXT["vocab_size"]).eval()
    head = torch.randn(
        TEXT["vocab_size"], TEXT["hidden_size"], generator=torch.Generator().manual_seed(1)
    )
    state = {f"model.{k}": v for k, v in upstream.state_dict().items()} | {"lm_head.weight": head}
    load_part(ours, state, "")
    ids = torch.randint(0, TEXT["vocab_size"], (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = upstream(input_ids=ids[None]).last_hidden_state[0] @ head.T
        got = ours.compute_logits(ours(ids, DenseCausalAttention(len(ids))))
    torch.testing.assert_close(got, want, **TOL)


def _talker_config() -> Any:
    text = {**TEXT, "shared_expert_intermediate_size": 24, "norm_topk_prob": False}
    predictor = {
        key: TEXT[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    } | {
        "vocab_size": 40,
        "num_hidden_layers": 1,
        "num_code_groups": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    return hf_config.Qwen3OmniMoeTalkerConfig(
        text_config=text,
        code_predictor_config=predictor,
        num_code_groups=4,
        thinker_hidden_size=48,
        spatial_merge_size=2,
    )


def _talkers() -> tuple[Any, Talker]:
    upstream = hf.Qwen3OmniMoeTalkerForConditionalGeneration(_talker_config()).eval()
    _randomise(upstream, 3)
    cfg = Qwen3Config.from_hf(TEXT)
    from dataclasses import replace

    ours = Talker(
        replace(cfg, shared_expert_intermediate_size=24, norm_topk_prob=False),
        vocab=TEXT["vocab_size"],
        thinker_hidden=48,
        predictor=replace(cfg, num_hidden_layers=1, num_experts=0),
        codebook_size=40,
        groups=4,
    ).eval()
    load_part(ours, upstream.state_dict(), "")
    return upstream, ours


def test_talker_hidden_codec_logits_and_projection_match_upstream() -> None:
    upstream, ours = _talkers()
    gen = torch.Generator().manual_seed(4)
    thinker_rows = torch.randn(9, 48, generator=gen)
    with torch.no_grad():
        rows = upstream.text_projection(thinker_rows)
        torch.testing.assert_close(ours.text_projection(thinker_rows), rows, **TOL)
        want = upstream.codec_head(upstream.model(inputs_embeds=rows[None]).last_hidden_state[0])
        got = ours.codec_head(ours.model(rows, DenseCausalAttention(9)))
    torch.testing.assert_close(got, want, **TOL)


def test_code_predictor_matches_upstream_per_group() -> None:
    upstream, ours = _talkers()
    gen = torch.Generator().manual_seed(5)
    context = torch.randn(2, 32, generator=gen)
    codes = [7, 19]
    with torch.no_grad():
        cp = upstream.code_predictor
        rows = torch.cat(
            [context]
            + [cp.model.codec_embedding[g](torch.tensor([c])) for g, c in enumerate(codes)]
        )
        want_hidden = cp.model(inputs_embeds=rows[None]).last_hidden_state[0]
        ours_rows = torch.cat(
            [context] + [ours.code_predictor.embed(g + 1, c)[None] for g, c in enumerate(codes)]
        )
        got_hidden = ours.code_predictor.model(ours_rows, DenseCausalAttention(4))
        torch.testing.assert_close(got_hidden, want_hidden, **TOL)
        for group in range(3):
            torch.testing.assert_close(
                ours.code_predictor.lm_head[group](got_hidden[group + 1]),
                cp.lm_head[group](want_hidden[group + 1]),
                **TOL,
            )


def test_code2wav_matches_upstream_beyond_its_sliding_window() -> None:
    fields = {
        "codebook_size": 32,
        "num_quantizers": 4,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "sliding_window": 6,
        "upsample_rates": [4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 16,
    }
    upstream = hf.Qwen3OmniMoeCode2Wav(hf_config.Qwen3OmniMoeCode2WavConfig(**fields)).eval()
    seeded_init(upstream, 6)
    ours = Code2Wav(Code2WavConfig.from_hf(fields)).eval()
    load_part(ours, upstream.state_dict(), "")
    codes = torch.randint(0, 32, (4, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = upstream(codes[None]).reshape(-1)
        got = ours(codes)
    assert got.shape == want.shape
    assert (want.abs() < 1).float().mean() > 0.1, "the test signal is all clipped"
    torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():
        chunked = upstream.chunked_decode(codes[None], chunk_size=8, left_context_size=5).reshape(
            -1
        )
    from mstar_async.models.qwen3_omni.code2wav import chunked_decode

    torch.testing.assert_close(chunked_decode(ours, codes.T, 8, 5), chunked, **TOL)


def test_released_expert_layout_and_language_model_prefix_are_normalised() -> None:
    gate = [torch.full((3, 2), float(e)) for e in range(2)]
    up = [torch.full((3, 2), 10.0 + e) for e in range(2)]
    down = [torch.full((2, 3), 20.0 + e) for e in range(2)]
    state = {"thinker.model.language_model.norm.weight": torch.ones(2)}
    for e in range(2):
        prefix = f"thinker.model.layers.0.mlp.experts.{e}"
        state |= {
            f"{prefix}.gate_proj.weight": gate[e],
            f"{prefix}.up_proj.weight": up[e],
            f"{prefix}.down_proj.weight": down[e],
        }
    out = upstream_keys(state)
    assert sorted(out) == [
        "thinker.model.layers.0.mlp.experts.down_proj",
        "thinker.model.layers.0.mlp.experts.gate_up_proj",
        "thinker.model.norm.weight",
    ]
    fused = out["thinker.model.layers.0.mlp.experts.gate_up_proj"]
    assert fused.shape == (2, 6, 2)
    assert fused[1, :3].eq(1).all() and fused[1, 3:].eq(11).all()
    assert out["thinker.model.layers.0.mlp.experts.down_proj"][0].eq(20).all()
    assert fuse_expert_keys({"a": torch.ones(1)}).keys() == {"a"}


def test_loading_names_what_is_missing() -> None:
    ours = Thinker(Qwen3Config.from_hf(TEXT), TEXT["vocab_size"])
    with pytest.raises(ValueError, match="missing"):
        load_part(ours, {"thinker.lm_head.weight": torch.zeros(96, 32)}, "thinker.")
