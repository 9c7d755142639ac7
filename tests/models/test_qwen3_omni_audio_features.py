"""qwen3-omni's log-mel features: whole against transformers' ``WhisperFeatureExtractor
(feature_size=128)``, streamed against whole, and with the audio encoder against a tiny
thinker's ``get_audio_features`` (PCM in, thinker rows out)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from mstar_async.models.checkpoints.streaming import StateDictSource, empty_module
from mstar_async.models.qwen3_omni import audio_features
from mstar_async.models.qwen3_omni.audio_encoder import (
    AudioEncoder,
    AudioEncoderConfig,
    audio_tower_state,
)
from mstar_async.models.qwen3_omni.audio_features import LogMelStream, log_mel, mel_filters
from mstar_async.models.qwen3_omni.decoder import seeded_init
from mstar_async.models.qwen3_omni.weights import load_upstream

pytestmark = pytest.mark.timeout(60)

TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _pcm(seconds: float, loudest: float, width: float = 0.3, seed: int = 0) -> torch.Tensor:
    """A rising tone in noise, loudest ``loudest`` seconds in and faint (-80 dB) far from it."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16_000)) / 16_000
    tone = torch.sin(2 * math.pi * 200 * t * (1 + t)) + 0.1 * torch.randn(t.shape, generator=gen)
    return tone * torch.exp(-(((t - loudest) / width) ** 2)) * 0.5 + 1e-4 * tone


def _whisper() -> Any:
    whisper = pytest.importorskip("transformers.models.whisper.feature_extraction_whisper")
    return whisper.WhisperFeatureExtractor(feature_size=128)


@pytest.mark.parametrize("seconds", [3.0, 2.3217])
def test_log_mel_matches_whisper_feature_extractor(seconds: float) -> None:
    extractor = _whisper()
    np.testing.assert_allclose(mel_filters().numpy(), extractor.mel_filters, atol=1e-7)
    pcm = _pcm(seconds, loudest=1.2)
    want = extractor(
        pcm.numpy(), sampling_rate=16_000, padding="longest", return_tensors="pt"
    ).input_features[0]
    got = log_mel(pcm)
    assert got.shape == (128, pcm.numel() // 160) == want.shape
    # Faint frames sit on the floor, max - 8 (2 after scaling): the floor is exercised.
    assert float(got.min()) == pytest.approx(float(got.max()) - 2.0, abs=1e-5)
    assert (got == got.min()).float().mean() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _pieces(total: int, sizes: Sequence[int]) -> Iterator[slice]:
    start, i = 0, 0
    while start < total:
        yield slice(start, start + sizes[i % len(sizes)])
        start += sizes[i % len(sizes)]
        i += 1


def _stream_mel(pcm: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    stream = LogMelStream()
    out = []
    for piece in _pieces(pcm.numel(), sizes):
        before = stream.frames
        frames = stream.push(pcm[piece])
        pushed = stream.samples
        # Frame t comes out once samples up to 160 t + 199 are in (and sample 200, which the
        # start reflection reads).
        determined = (pushed - 200) // 160 + 1 if pushed >= 201 else 0
        assert stream.frames == determined and frames.shape == (128, determined - before)
        out.append(frames)
    out.append(stream.finish())
    assert stream.frames == pcm.numel() // 160
    return torch.cat(out, dim=1)


def test_streamed_frames_come_out_as_soon_as_determined_and_piece_sizes_do_not_matter() -> None:
    pcm = _pcm(2.0, loudest=1.2)
    # 20 ms and 100 ms pieces, and a ragged rhythm with empty and one-sample pieces.
    streams = [_stream_mel(pcm, sizes) for sizes in ([320], [1600], [1, 999, 0, 77, 4410])]
    assert streams[0].shape == (128, 200)
    for other in streams[1:]:
        torch.testing.assert_close(other, streams[0], atol=1e-6, rtol=0)


def test_streamed_frames_equal_whole_frames_from_the_loudest_one_on() -> None:
    pcm = _pcm(3.0, loudest=1.9)
    whole = log_mel(pcm)
    streamed = _stream_mel(pcm, [640])
    padded = torch.cat([pcm[1:201].flip(0), pcm, pcm[-201:-1].flip(0)])
    raw = audio_features._log_power(padded, pcm.numel() // 160)
    loudest = int(raw.max(dim=0).values.argmax())
    assert 180 <= loudest <= 200
    # Before the floor they are the same numbers, edge frames included; the stream floors at
    # the running maximum - 8.
    running = torch.cummax(raw.max(dim=0).values, dim=0).values
    torch.testing.assert_close(streamed, (torch.maximum(raw, running - 8.0) + 4.0) / 4.0, **TOL)
    torch.testing.assert_close(streamed[:, loudest:], whole[:, loudest:], **TOL)
    # Before the loudest frame the stream keeps more of the faint frames' depth: lower, never
    # higher, and floored again at the utterance's maximum - 8 they are the whole's.
    assert (streamed <= whole + 1e-5).all()
    assert (whole[:, :loudest] - streamed[:, :loudest]).max() > 0.5
    torch.testing.assert_close(torch.maximum(streamed, whole.max() - 2.0), whole, **TOL)


def test_the_mel_stream_refuses_what_it_cannot_do() -> None:
    stream = LogMelStream()
    assert stream.push(torch.zeros(200)).shape == (128, 0)
    with pytest.raises(ValueError, match="at least 201 samples"):
        stream.finish()
    with pytest.raises(ValueError, match="one channel"):
        stream.push(torch.zeros(2, 10))
    assert stream.samples == 200
    # The 201st sample completes the start reflection and frame 0, the only frame of 201.
    assert stream.push(torch.zeros(1)).shape == (128, 1)
    assert stream.finish().shape == (128, 0)
    with pytest.raises(RuntimeError, match="after finish"):
        stream.push(torch.zeros(1))
    with pytest.raises(ValueError, match="at least 201 samples"):
        log_mel(torch.zeros(200))


def test_features_and_encoder_together_match_the_thinkers_audio_features() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
    hf_config = pytest.importorskip(
        "transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe"
    )
    text = {
        "vocab_size": 96,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
    }
    audio = {
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": 48,
        "downsample_hidden_size": 8,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 48,
        "deepstack_visual_indexes": [0],
        "num_position_embeddings": 16,
    }
    config = hf_config.Qwen3OmniMoeThinkerConfig(
        text_config=text, audio_config=audio, vision_config=vision
    )
    thinker = hf.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    seeded_init(thinker, 4)
    ours = empty_module(
        lambda: AudioEncoder(AudioEncoderConfig.from_hf(config.audio_config.to_dict()))
    )
    state = {f"thinker.{k}": v for k, v in thinker.state_dict().items()}
    load_upstream(ours, StateDictSource(audio_tower_state(state)), "")
    # 936 frames: windows of 800 and 136 frames, the last chunk 36 frames.
    pcm = _pcm(9.37, loudest=5.0, width=3.0)
    inputs = _whisper()(
        pcm.numpy(),
        sampling_rate=16_000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        want = thinker.get_audio_features(
            inputs.input_features, feature_attention_mask=inputs.attention_mask
        ).last_hidden_state
        (got,) = ours([log_mel(pcm)])
    assert got.shape == want.shape == (ours.config.output_length(936), 48) == (122, 48)
    torch.testing.assert_close(got, want, **TOL)
