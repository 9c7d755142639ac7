"""qwen3-omni's audio encoder streamed: mel frames pushed as they come, chunks convolved and
windows attended as they complete, several utterances batched per step, against each
utterance encoded whole."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from mstar_async.models.qwen3_omni.audio_encoder import AudioEncoder, seeded_audio_encoder
from mstar_async.models.qwen3_omni.audio_stream import AudioEncoderStream, encode_streams
from mstar_async.models.qwen3_omni.config import SIZES

pytestmark = pytest.mark.timeout(60)

TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    audio = SIZES["tiny"].audio
    assert audio is not None
    # Windows of two chunks (200 frames) so a few seconds cross several of them.
    return seeded_audio_encoder(replace(audio, n_window_infer=200), 0)


def _window_rows(encoder: AudioEncoder, frames: int) -> int:
    """Rows returned before the end: only for complete windows."""
    cfg = encoder.config
    return frames // (cfg.chunk_frames * cfg.window_chunks) * cfg.chunk_tokens * cfg.window_chunks


def test_streams_encoded_together_equal_each_utterance_encoded_whole(encoder: AudioEncoder) -> None:
    lengths = [37, 100, 200, 250, 401, 530, 999]
    gen = torch.Generator().manual_seed(1)
    mels = [torch.randn(128, n, generator=gen) for n in lengths]
    streams = [AudioEncoderStream(encoder.config) for _ in mels]
    rows: list[list[torch.Tensor]] = [[] for _ in mels]
    pushed = [0] * len(mels)
    # 2 to 10 mel frames a push (20 to 100 ms), a different rhythm per utterance, all streams
    # stepped together so each step batches utterances at different stages.
    rhythms = [[2, 10, 5], [7], [10, 3], [4, 9], [10], [6, 2, 8], [3, 10]]
    step = 0
    while not all(s.done for s in streams):
        for i, stream in enumerate(streams):
            if stream.finished:
                continue
            size = rhythms[i][step % len(rhythms[i])]
            stream.push(mels[i][:, pushed[i] : pushed[i] + size])
            pushed[i] = min(pushed[i] + size, lengths[i])
            if pushed[i] == lengths[i]:
                stream.finish()
        for i, new in enumerate(encode_streams(encoder, streams)):
            rows[i].append(new)
            if not streams[i].finished:
                assert streams[i].tokens == _window_rows(encoder, pushed[i])
        step += 1
    with torch.no_grad():
        whole = encoder(mels)
    for i, want in enumerate(whole):
        got = torch.cat(rows[i])
        assert got.shape == (encoder.config.output_length(lengths[i]), 64)
        torch.testing.assert_close(got, want, **TOL)
    assert [r.shape for r in encode_streams(encoder, streams)] == [(0, 64)] * len(streams)


def test_a_window_is_encoded_the_step_its_last_frame_arrives(encoder: AudioEncoder) -> None:
    stream = AudioEncoderStream(encoder.config)
    mel = torch.randn(128, 230, generator=torch.Generator().manual_seed(2))
    stream.push(mel[:, :199])
    assert encode_streams(encoder, [stream])[0].shape == (0, 64)
    stream.push(mel[:, 199:])
    first = encode_streams(encoder, [stream])[0]
    assert first.shape == (26, 64) and stream.tokens == 26
    assert encode_streams(encoder, [stream])[0].shape == (0, 64)
    stream.finish()
    last = encode_streams(encoder, [stream])[0]
    assert last.shape == (4, 64) and stream.done
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([first, last]), encoder([mel])[0], **TOL)


def test_the_released_window_of_eight_seconds(encoder: AudioEncoder) -> None:
    released = seeded_audio_encoder(replace(encoder.config, n_window_infer=800), 0)
    mel = torch.randn(128, 1234, generator=torch.Generator().manual_seed(3))
    stream = AudioEncoderStream(released.config)
    sizes = []
    for start in range(0, 1234, 10):
        stream.push(mel[:, start : start + 10])
        sizes.append(encode_streams(released, [stream])[0].shape[0])
    stream.finish()
    sizes.append(encode_streams(released, [stream])[0].shape[0])
    assert [s for s in sizes if s] == [104, 57] and sizes.index(104) == 79  # frame 800
    assert stream.done and stream.tokens == released.config.output_length(1234) == 161


def test_the_encoder_stream_refuses_what_it_cannot_do(encoder: AudioEncoder) -> None:
    stream = AudioEncoderStream(encoder.config)
    with pytest.raises(ValueError, match="at least one mel frame"):
        stream.finish()
    with pytest.raises(ValueError, match=r"\[128, n\]"):
        stream.push(torch.zeros(64, 3))
    stream.push(torch.zeros(128, 3))
    with pytest.raises(ValueError, match="listed twice"):
        encode_streams(encoder, [stream, stream])
    other = seeded_audio_encoder(replace(encoder.config, n_window_infer=800), 0)
    with pytest.raises(ValueError, match="config differs"):
        encode_streams(other, [stream])
    assert stream.frames == 3 and stream.tokens == 0
    stream.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        stream.push(torch.zeros(128, 1))
    assert encode_streams(encoder, [stream])[0].shape == (1, 64)


def test_seeded_sizes_feed_the_thinker() -> None:
    for cfg in SIZES.values():
        assert cfg.audio is not None and cfg.audio.output_dim == cfg.thinker.hidden_size
    tiny = SIZES["tiny"].audio
    assert tiny is not None
    a, b = seeded_audio_encoder(tiny, 7), seeded_audio_encoder(tiny, 7)
    mel = torch.randn(128, 150, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = a([mel])[0]
        assert torch.equal(out, b([mel])[0])
    # Seeded scales keep activations O(1): neither vanishing nor exploding.
    assert 0.1 < float(out.std()) < 10.0
