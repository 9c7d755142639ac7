"""A decoder window's convolutions run over the frames its kept audio depends on only: the
audio equals decoding the whole window, for code2wav (transposed convolutions trimmed at both
ends) and the 12 Hz speech decoder (trimmed at the right end only). The speech decoder can
also continue from its convolutions' state after some frames (a registered voice's reference
codes), with the same audio; code2wav, which looks ahead, refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_async.models.qwen3_omni.code2wav import Code2Wav, ConvTails, FrameDecoder, VoiceTails
from mstar_async.models.qwen3_omni.config import SIZES as OMNI_SIZES
from mstar_async.models.qwen3_tts.config import SIZES as TTS_SIZES
from mstar_async.models.qwen3_tts.speech_decoder import SpeechDecoder

pytestmark = pytest.mark.timeout(120)


def _randomized(decoder: FrameDecoder) -> FrameDecoder:
    # Weights large enough that every layer's far taps change the audio measurably, in float64
    # so that the comparison sees what the windows leave out, not float32's rounding through
    # activations of ~200.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in decoder.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return decoder.double().eval()


@pytest.fixture(scope="module")
def decoders() -> dict[str, FrameDecoder]:
    torch.manual_seed(0)
    return {
        "code2wav": _randomized(Code2Wav(OMNI_SIZES["tiny"].code2wav)),
        "speech_decoder": _randomized(SpeechDecoder(TTS_SIZES["tiny"].decoder)),
    }


@pytest.mark.parametrize("name", ["code2wav", "speech_decoder"])
def test_upstream_shapes_leave_out_fifteen_of_twenty_five_context_frames(
    decoders: dict[str, FrameDecoder], name: str
) -> None:
    decoder = decoders[name]
    # Upsampling by (8, 5, 4, 3) x (2, 2): the convolutions see 10 frames back.
    assert decoder.config.upsample_rates == (8, 5, 4, 3)
    assert [decoder.frames_to_skip(c) for c in (0, 8, 10, 11, 25)] == [0, 0, 0, 1, 15]


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(["code2wav", "speech_decoder"]),
    context=st.integers(0, 30),
    new=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_a_window_is_its_whole_decode_cut_at_the_context(
    decoders: dict[str, FrameDecoder], name: str, context: int, new: int, seed: int
) -> None:
    decoder = decoders[name]
    cfg = decoder.config
    gen = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, cfg.codebook_size, (context + new, cfg.num_quantizers), generator=gen)
    skip = decoder.frames_to_skip(context)
    with torch.inference_mode():
        whole = decoder.unclamped(frames.T)[context * cfg.total_upsample :]
        part = decoder.unclamped(frames.T, skip)[(context - skip) * cfg.total_upsample :]
        window = decoder.decode_window(frames, context)
    # Compared before the clamp: activations this large saturate most samples.
    assert part.shape == whole.shape
    torch.testing.assert_close(part, whole, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(window, whole.clamp(-1.0, 1.0), atol=1e-9, rtol=1e-9)


def test_leaving_out_one_frame_more_changes_the_audio(decoders: dict[str, FrameDecoder]) -> None:
    """The receptive field is not overstated: one frame fewer and the audio differs."""
    decoder = decoders["speech_decoder"]
    cfg = decoder.config
    frames = torch.randint(0, cfg.codebook_size, (33, cfg.num_quantizers))
    skip = decoder.frames_to_skip(25)
    with torch.inference_mode():
        exact = decoder.unclamped(frames.T, skip)[(25 - skip) * cfg.total_upsample :]
        short = decoder.unclamped(frames.T, skip + 1)[(25 - skip - 1) * cfg.total_upsample :]
    assert (short - exact).abs().max() > 1e-3


@settings(max_examples=8, deadline=None)
@given(context=st.integers(1, 30), new=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_a_window_continued_from_kept_state_is_the_window_decoded_whole(
    decoders: dict[str, FrameDecoder], context: int, new: int, seed: int
) -> None:
    decoder = decoders["speech_decoder"]
    cfg = decoder.config
    gen = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, cfg.codebook_size, (context + new, cfg.num_quantizers), generator=gen)
    with torch.inference_mode():
        tails = decoder.conv_tails(frames[:context])
        continued = decoder.decode_after(frames, context, tails)
        whole = decoder.decode_window(frames, context)
    assert continued.shape == whole.shape == (new * cfg.total_upsample,)
    torch.testing.assert_close(continued, whole, atol=1e-9, rtol=1e-9)


def test_code2wav_cannot_continue_a_stream(decoders: dict[str, FrameDecoder]) -> None:
    """Its transposed convolutions are trimmed at their start: each output looks one input
    ahead, so no state after some frames gives the next frames' audio."""
    decoder = decoders["code2wav"]
    frames = torch.zeros(4, decoder.config.num_quantizers, dtype=torch.long)
    with pytest.raises(ValueError, match="cannot continue through CausalTransConv"):
        decoder.conv_tails(frames)


def test_voice_tails_keep_the_latest_voices_and_remake_changed_frames() -> None:
    made: list[str] = []

    def make(frames: torch.Tensor) -> ConvTails:
        made.append(str(frames.tolist()))
        return {}

    kept = VoiceTails(limit=2)
    a, b = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long)
    kept.tails("a", a, make)
    kept.tails("b", b, make)
    kept.tails("a", a, make)  # kept: not made again, and now the most recent
    kept.tails("c", a, make)  # past the limit: "b" goes
    assert len(made) == 3 and len(kept) == 2
    assert kept.forget(["b", "a"]) == {"dropped": [False, True]}
    kept.tails("c", b, make)  # other frames under the same key are made again
    assert len(made) == 4 and len(kept) == 1
