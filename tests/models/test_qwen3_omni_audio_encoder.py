"""qwen3-omni's audio encoder against transformers' ``Qwen3OmniMoeAudioEncoder`` on a tiny random
config, its weights loaded by upstream names (the identity mapping), in float32."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from mstar_async.models.checkpoints.streaming import StateDictSource, empty_module
from mstar_async.models.qwen3_omni.audio_encoder import (
    AudioEncoder,
    AudioEncoderConfig,
    audio_tower_state,
)
from mstar_async.models.qwen3_omni.config import OmniConfig
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.weights import load_upstream

hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
hf_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

pytestmark = pytest.mark.timeout(60)

TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}

# n_window_infer 200: attention windows of two chunks (26 tokens), so a few seconds of frames
# cross several windows.
AUDIO = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "output_dim": 48,
    "downsample_hidden_size": 8,
    "n_window_infer": 200,
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def encoders() -> tuple[Any, AudioEncoder]:
    upstream = hf.Qwen3OmniMoeAudioEncoder(hf_config.Qwen3OmniMoeAudioEncoderConfig(**AUDIO))
    seeded_init(upstream.eval(), 0)
    ours = empty_module(lambda: AudioEncoder(AudioEncoderConfig.from_hf(AUDIO)))
    assert set(ours.state_dict()) == set(upstream.state_dict())
    load_upstream(ours, StateDictSource(upstream.state_dict()), "")
    return upstream, ours


def _mels(lengths: Sequence[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(128, n, generator=gen) for n in lengths]


def _upstream(upstream: Any, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream's encoding of a batch: frames concatenated, lengths beside them."""
    lengths = torch.tensor([m.shape[1] for m in mels])
    with torch.no_grad():
        rows = upstream(torch.cat(list(mels), dim=1), feature_lens=lengths).last_hidden_state
    sizes = hf._get_feat_extract_output_lengths(lengths).tolist()
    return list(rows.split(sizes))


def test_output_length_is_upstreams() -> None:
    cfg = AudioEncoderConfig.from_hf(AUDIO)
    frames = torch.arange(1, 1001)
    want = hf._get_feat_extract_output_lengths(frames).tolist()
    assert [cfg.output_length(n) for n in range(1, 1001)] == want
    assert cfg.output_length(100) == 13 and cfg.output_length(250) == 33


@pytest.mark.parametrize("frames", [37, 100, 250, 530])
def test_one_utterance_matches_upstream(encoders: tuple[Any, AudioEncoder], frames: int) -> None:
    upstream, ours = encoders
    (mel,) = _mels([frames], frames)
    (want,) = _upstream(upstream, [mel])
    with torch.no_grad():
        (got,) = ours([mel])
    assert got.shape == (ours.config.output_length(frames), 48)
    assert want.abs().max() > 0.1, "the test signal is all zero"
    torch.testing.assert_close(got, want, **TOL)


def test_a_ragged_batch_matches_upstream(encoders: tuple[Any, AudioEncoder]) -> None:
    upstream, ours = encoders
    # Tails of 30, 50, 1 and 0 frames after full chunks; 530 frames span three windows.
    mels = _mels([130, 450, 201, 530, 100], 1)
    want = _upstream(upstream, mels)
    with torch.no_grad():
        got = ours(mels)
    assert [g.shape[0] for g in got] == [17, 59, 27, 69, 13]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_a_short_utterance_is_encoded_as_upstream_encodes_it_alone(
    encoders: tuple[Any, AudioEncoder],
) -> None:
    upstream, ours = encoders
    short, long = _mels([37, 260], 2)
    (alone,) = _upstream(upstream, [short])
    batched = _upstream(upstream, [short, long])
    with torch.no_grad():
        got = ours([short, long])
    # Upstream pads the short utterance's only chunk to the batch's 100 frames, which changes
    # its last token's convolutions (and through attention every row): its result depends on
    # the batch. Ours does not.
    assert (batched[0] - alone).abs().max() > 1e-4
    torch.testing.assert_close(got[0], alone, **TOL)
    torch.testing.assert_close(got[1], batched[1], **TOL)


def test_the_tower_loads_from_either_checkpoint_layout(encoders: tuple[Any, AudioEncoder]) -> None:
    upstream, ours = encoders
    released = {f"thinker.audio_tower.{k}": v for k, v in upstream.state_dict().items()}
    in_memory = {f"thinker.model.audio_tower.{k}": v for k, v in upstream.state_dict().items()}
    other = {"thinker.model.norm.weight": torch.ones(2), "talker.codec_head.weight": torch.ones(2)}
    for state in (released | other, in_memory | other):
        fresh = empty_module(lambda: AudioEncoder(ours.config))
        load_upstream(fresh, StateDictSource(audio_tower_state(state)), "")
        for name, value in upstream.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], value), name
    assert audio_tower_state(other) == {}


def test_omni_config_reads_the_audio_config() -> None:
    audio = hf_config.Qwen3OmniMoeAudioEncoderConfig(**{**AUDIO, "output_dim": 64}).to_dict()
    thinker = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    talker = {**thinker, "vocab_size": 80}
    config = {
        "thinker_config": {"text_config": thinker, "audio_config": audio},
        "talker_config": {
            "text_config": talker,
            "code_predictor_config": talker,
            "num_code_groups": 4,
        },
        "code2wav_config": {"num_quantizers": 4},
    }
    cfg = OmniConfig.from_hf(config)
    assert cfg.audio == AudioEncoderConfig(
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=64,
        downsample_hidden_size=8,
        n_window_infer=200,
    )
    audio["output_dim"] = 48
    with pytest.raises(ValueError, match="48-wide rows but the thinker is 64 wide"):
        OmniConfig.from_hf(config)
    del config["thinker_config"]["audio_config"]
    assert OmniConfig.from_hf(config).audio is None
