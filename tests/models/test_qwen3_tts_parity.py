"""qwen3-tts against the ``qwen-tts`` package's own modules (0.1.1, installed with --no-deps).

Upstream's ``Qwen3TTSForConditionalGeneration`` and 12 Hz ``Qwen3TTSTokenizerV2Decoder`` are
built from tiny configs with seeded weights; ours load their state dicts by upstream names
(strictly, through the model's own loaders), and both run the same inputs in float32: the
talker's hidden states and codec logits, the code predictor, the speaker encoder on PCM (mel
features included), the decoder and its ``chunked_decode``, and upstream's prompt for every
kind of voice, captured from its ``generate``. Then a checkpoint folder in upstream's layout
runs through the runtime greedily, and its frames (under upstream's default repetition penalty,
none, and a strong one; the last two resuming the voice's kept prompt rows) and audio equal a
step-by-step loop over upstream's modules.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file

from mstar_async.models import build_model
from mstar_async.models.checkpoints import smollm2_folder
from mstar_async.models.checkpoints.streaming import StateDictSource, empty_module
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, seeded_init
from mstar_async.models.qwen3_omni.weights import load_upstream
from mstar_async.models.qwen3_tts.config import TTSConfig, tiny_mimi
from mstar_async.models.qwen3_tts.prompt import SPEAKER, PromptIds, lay_out
from mstar_async.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from mstar_async.models.qwen3_tts.speech_decoder import SpeechDecoder, chunked_decode
from mstar_async.models.qwen3_tts.speech_encoder import SpeechEncoder, upstream_name
from mstar_async.models.qwen3_tts.voice import VoicePrompt
from mstar_async.models.qwen3_tts.weights import _load_whole, _seed_codebooks, build_talker
from mstar_async.outputs import AudioChunk, LatentOutput
from mstar_async.runtime import open_runtime
from tests.models.qwen3_tts_upstream import load

pytestmark = [
    pytest.mark.timeout(90),
    # Upstream's modules call transformers APIs that transformers 5 deprecates.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TOL = {"atol": 1e-4, "rtol": 1e-4}
#: A repetition penalty strong enough to change the tiny model's greedy frames.
PENALTY = 1.5
#: A registered voice's id: its prompt rows' KV is kept and resumed.
VOICE_ID = "voice_" + "1" * 24
TEXT_VOCAB = 49152 + 3  # SmolLM2's vocabulary and the three tts ids after it
TTS_BOS, TTS_EOS, TTS_PAD = 49152, 49153, 49154
CODEBOOK, GROUPS = 64, 4
CODEC = {
    "codec_pad_id": 64,
    "codec_bos_id": 65,
    "codec_eos_token_id": 66,
    "codec_think_id": 70,
    "codec_nothink_id": 71,
    "codec_think_bos_id": 72,
    "codec_think_eos_id": 73,
}
TALKER = {
    "pad_token_id": None,
    "vocab_size": 88,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "text_hidden_size": 48,
    "text_vocab_size": TEXT_VOCAB,
    "num_code_groups": GROUPS,
    "spk_id": {"ryan": 76, "vivian": 77},
    "codec_language_id": {"english": 80},
    "spk_is_dialect": {"ryan": False, "vivian": False},
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "interleaved": True},
    **CODEC,
    "code_predictor_config": {
        "pad_token_id": None,
        "vocab_size": CODEBOOK,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "num_code_groups": GROUPS,
    },
}
SPEAKER_ENC = {
    "enc_dim": 64,
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_attention_channels": 16,
    "enc_se_channels": 16,
}
DECODER = {
    "codebook_size": CODEBOOK,
    "codebook_dim": 32,
    "hidden_size": 32,
    "latent_dim": 48,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_quantizers": GROUPS,
    "decoder_dim": 32,
    "sliding_window": 6,
}
IDS = PromptIds(64, 65, 70, 71, 72, 73, TTS_BOS, TTS_EOS, TTS_PAD, GROUPS)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def up() -> tuple[Any, Any, Any, Any]:
    try:
        return load()
    except ImportError as exc:
        pytest.skip(str(exc))


def _config_dicts(up: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = {
        "tts_model_type": "base",
        "im_start_token_id": 1,
        "tts_bos_token_id": TTS_BOS,
        "tts_eos_token_id": TTS_EOS,
        "tts_pad_token_id": TTS_PAD,
        "talker_config": TALKER,
        "speaker_encoder_config": SPEAKER_ENC,
    }
    tokenizer = {
        "decoder_config": DECODER,
        "encoder_config": tiny_mimi(CODEBOOK, GROUPS),
        "encoder_valid_num_quantizers": GROUPS,
    }
    return cfg, tokenizer


@pytest.fixture(scope="module")
def upstream(up: Any) -> Any:
    cfg, _ = _config_dicts(up)
    model = up[1].Qwen3TTSForConditionalGeneration(up[0].Qwen3TTSConfig(**cfg)).eval()
    seeded_init(model, 7)
    return model


@pytest.fixture(scope="module")
def upstream_decoder(up: Any) -> Any:
    decoder = up[3].Qwen3TTSTokenizerV2Decoder(up[2].Qwen3TTSTokenizerV2DecoderConfig(**DECODER))
    seeded_init(decoder, 8)
    _seed_codebooks(decoder, 8)
    return decoder.eval()


@pytest.fixture(scope="module")
def ours(up: Any) -> TTSConfig:
    cfg, tokenizer = _config_dicts(up)
    return TTSConfig.from_hf(cfg, tokenizer)


def _talker(ours: TTSConfig, upstream: Any) -> Any:
    talker = empty_module(lambda: build_talker(ours))
    load_upstream(talker, StateDictSource(upstream.state_dict()), "talker.")
    return talker


def test_config_reads_upstreams(ours: TTSConfig) -> None:
    assert ours.num_code_groups == GROUPS and ours.codebook_size == CODEBOOK
    assert dict(ours.speakers) == {"ryan": 76, "vivian": 77}
    assert dict(ours.languages) == {"english": 80}
    assert (ours.codec_eos, ours.codec_think, ours.codec_nothink) == (66, 70, 71)
    assert ours.predictor.hidden_size == 32 and ours.talker.hidden_size == 64
    assert ours.can_clone and ours.text_hidden_size == 48


def test_talker_and_code_predictor_match(ours: TTSConfig, upstream: Any) -> None:
    talker = _talker(ours, upstream)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen)
    with torch.inference_mode():
        theirs = upstream.talker.model(inputs_embeds=x[None]).last_hidden_state[0]
        mine = talker.model(x, DenseCausalAttention(9))
        torch.testing.assert_close(mine, theirs, **TOL)
        torch.testing.assert_close(
            talker.codec_head(mine), upstream.talker.codec_head(theirs), **TOL
        )
        ids = torch.tensor([5, 100, TTS_PAD])
        theirs_text = upstream.talker.text_projection(upstream.talker.model.text_embedding(ids))
        torch.testing.assert_close(talker.text_rows(ids), theirs_text, **TOL)
        # Code predictor: prefill [hidden, embed(code 0)] -> codebook 1, then codebook 2.
        context = torch.stack([mine[-1], talker.codec_embedding.weight[3]])
        pred = upstream.talker.code_predictor
        # Upstream's prefill step: project, run the stack, lm_head[len - 2] (its forward's
        # output class no longer builds under transformers 5, so its three calls run here).
        out = pred.model(inputs_embeds=pred.small_to_mtp_projection(context[None]))
        logits = pred.lm_head[0](out.last_hidden_state[0, -1])
        hidden = talker.code_predictor.model(
            talker.code_predictor.project(context), DenseCausalAttention(2)
        )
        torch.testing.assert_close(talker.code_predictor.lm_head[0](hidden[-1]), logits, **TOL)
        step = talker.code_predictor.table(1).weight[7][None]
        rows = torch.cat(
            [talker.code_predictor.project(context), talker.code_predictor.project(step)]
        )
        emb = torch.cat([context[None], pred.model.codec_embedding[0](torch.tensor([[7]]))], 1)
        theirs2 = pred.model(inputs_embeds=pred.small_to_mtp_projection(emb)).last_hidden_state
        mine2 = talker.code_predictor.model(rows, DenseCausalAttention(3))
        torch.testing.assert_close(mine2, theirs2[0], **TOL)
        torch.testing.assert_close(
            talker.code_predictor.lm_head[1](mine2[-1]), pred.lm_head[1](theirs2[0, -1]), **TOL
        )


def test_speaker_encoder_matches(ours: TTSConfig, upstream: Any, up: Any) -> None:
    assert ours.speaker_encoder is not None
    encoder = SpeakerEncoder(ours.speaker_encoder)
    state = upstream.state_dict()
    _load_whole(encoder, StateDictSource(state), "speaker_encoder.", str)
    gen = torch.Generator().manual_seed(1)
    pcm = (torch.randn(24_000, generator=gen) * 0.1).clamp(-1, 1)
    theirs = upstream.extract_speaker_embedding(pcm.numpy(), 24_000)
    torch.testing.assert_close(encoder.embed(pcm), theirs.float(), **TOL)
    mel = up[1].mel_spectrogram(
        pcm[None],
        n_fft=1024,
        num_mels=128,
        sampling_rate=24_000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12_000,
    )
    from mstar_async.models.qwen3_tts.speaker_encoder import speaker_mel

    torch.testing.assert_close(speaker_mel(pcm), mel[0].T, atol=1e-4, rtol=1e-4)


#: float32 through some forty convolutions whose windows sum in another order than upstream's
#: (ours convolve only the frames a window's audio depends on): single samples differ by up to
#: 3e-4 on some CPUs (AVX-512 kernels), where a wrong frame or weight moves them by 1e-2 or more.
DECODER_TOL = {"atol": 5e-4, "rtol": 1e-3}


def test_speech_decoder_matches(ours: TTSConfig, upstream_decoder: Any) -> None:
    decoder = empty_module(lambda: SpeechDecoder(ours.decoder))
    load_upstream(decoder, StateDictSource(upstream_decoder.state_dict()), "")
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, CODEBOOK, (GROUPS, 40), generator=gen)
    with torch.inference_mode():
        theirs = upstream_decoder(codes[None])[0, 0]
        torch.testing.assert_close(decoder(codes), theirs, **DECODER_TOL)
        assert theirs.numel() == 40 * 1920 and theirs.abs().max() > 0
        chunked = upstream_decoder.chunked_decode(codes[None], chunk_size=8, left_context_size=25)
        torch.testing.assert_close(
            chunked_decode(decoder, codes.T, 8, 25), chunked[0, 0], **DECODER_TOL
        )


class _Captured(Exception):
    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kwargs = kwargs


def _upstream_prompt(upstream: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's talker prompt and trailing text rows, captured from its ``generate``."""

    def capture(**inner: Any) -> Any:
        raise _Captured(inner)

    upstream.talker.generate = capture
    try:
        with pytest.raises(_Captured) as caught:
            upstream.generate(**kwargs)
    finally:
        del upstream.talker.generate
    got = caught.value.kwargs
    return got["inputs_embeds"][0], got["trailing_text_hidden"][0]


def _rows(talker: Any, trailing: torch.Tensor, n: int) -> torch.Tensor:
    ids = [int(trailing[i]) if i < trailing.numel() else TTS_PAD for i in range(n)]
    return talker.text_rows(torch.tensor(ids))


@pytest.mark.parametrize(
    "case",
    [
        "speaker",
        "speaker-language-instruct-streamed",
        "instruct-only",
        "xvector",
        "icl-streamed-long-text",
        "icl-streamed-short-text",
        "icl-whole-text",
    ],
)
def test_prompt_matches_upstream(case: str, ours: TTSConfig, upstream: Any) -> None:
    talker = _talker(ours, upstream)
    text = list(range(300, 300 + (14 if "long" in case else 5)))
    chat = torch.tensor([[1, 10, 11, *text, 2, 11, 1, 10, 11]])
    instruct = [1, 12, 11, 400, 401, 2, 11] if "instruct" in case else []
    gen = torch.Generator().manual_seed(3)
    embedding = torch.randn(64, generator=gen)
    codes = torch.randint(0, CODEBOOK, (6, GROUPS), generator=gen)
    ref = [1, 10, 11, 500, 501, 502, 2, 11]
    streamed = "streamed" in case or case == "xvector"
    kwargs: dict[str, Any] = {
        "input_ids": [chat],
        "languages": ["english" if "language" in case else "auto"],
        "non_streaming_mode": not streamed,
    }
    mine: dict[str, Any] = {
        "language": 80 if "language" in case else None,
        "streaming_text": streamed,
        "instruct": instruct,
    }
    if instruct:
        kwargs["instruct_ids"] = [torch.tensor([instruct])]
    if case.startswith("speaker"):
        kwargs["speakers"] = ["ryan"]
        mine["speaker"] = 76
    elif case == "xvector" or case.startswith("icl"):
        icl = case.startswith("icl")
        kwargs["voice_clone_prompt"] = {
            "ref_code": [codes if icl else None],
            "ref_spk_embedding": [embedding],
            "x_vector_only_mode": [not icl],
            "icl_mode": [icl],
        }
        kwargs["ref_ids"] = [torch.tensor([ref])]
        mine["speaker"] = SPEAKER
        if icl:
            mine["ref_text"], mine["ref_codes"] = ref[3:-2], codes
    with torch.inference_mode():
        theirs, theirs_trailing = _upstream_prompt(upstream, **kwargs)
        prompt = lay_out(IDS, [1, 10, 11], text, **mine)
        rows = talker.prompt_rows(prompt.layout, embedding)
        torch.testing.assert_close(rows, theirs, **TOL)
        n = theirs_trailing.shape[0] + 2
        expected = torch.cat([theirs_trailing, _rows(talker, torch.zeros(0), 2)])
        torch.testing.assert_close(_rows(talker, prompt.trailing, n), expected, **TOL)
        # The rows every request of the voice shares (whose KV a registered voice keeps) are
        # exactly those upstream's prompt has alike for another text of the same length.
        other_text = [t + 300 for t in text]
        kwargs["input_ids"] = [torch.tensor([[1, 10, 11, *other_text, 2, 11, 1, 10, 11]])]
        other, _ = _upstream_prompt(upstream, **kwargs)
        k = prompt.voice_rows
        assert k == lay_out(IDS, [1, 10, 11], other_text, **mine).voice_rows
        assert torch.equal(theirs[:k], other[:k]) and not torch.allclose(theirs[k], other[k])


def _save_folder(tmp: Path, ours: TTSConfig, upstream: Any, upstream_decoder: Any, up: Any) -> Path:
    cfg, tokenizer_cfg = _config_dicts(up)
    folder = tmp / "qwen3-tts"
    (folder / "speech_tokenizer").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (smollm2_folder() / name).is_file():
            shutil.copy(smollm2_folder() / name, folder / name)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "speech_tokenizer" / "config.json").write_text(json.dumps(tokenizer_cfg))
    save_file(
        {k: v.contiguous() for k, v in upstream.state_dict().items()}, folder / "model.safetensors"
    )
    encoder = SpeechEncoder(ours.encoder or {})
    seeded_init(encoder, 9)
    _seed_codebooks(encoder, 9)
    state = {"decoder." + k: v for k, v in upstream_decoder.state_dict().items()}
    state.update({"encoder." + upstream_name(k): v for k, v in encoder.state_dict().items()})
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        folder / "speech_tokenizer" / "model.safetensors",
    )
    return folder


def _reference_frames(
    upstream: Any, rows: torch.Tensor, trailing: torch.Tensor, n: int, penalty: float
) -> list[torch.Tensor]:
    """Greedy frames from upstream's modules, every step recomputed densely: codebook 0 from
    ``codec_head`` after transformers' repetition penalty over the codebook-0 codes so far (as
    upstream's ``generate`` passes it; none at 1.0) and with the specials suppressed, the rest
    from the code predictor; the next row is the frame's embeddings plus the trailing text."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    talker = upstream.talker
    pred = talker.code_predictor
    repeats = RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None
    x, frames = rows[None], list[torch.Tensor]()
    for step in range(n):
        hidden = talker.model(inputs_embeds=x).last_hidden_state[0, -1]
        logits = talker.codec_head(hidden).float()
        if repeats is not None:
            spoken = torch.tensor([[int(f[0]) for f in frames]], dtype=torch.long)
            logits = repeats(spoken, logits[None])[0]
        logits[CODEBOOK:] = float("-inf")
        code0 = int(logits.argmax())
        seq = torch.stack([hidden, talker.model.codec_embedding.weight[code0]])[None]
        codes = [code0]
        for g in range(1, GROUPS):
            out = pred.model(inputs_embeds=pred.small_to_mtp_projection(seq)).last_hidden_state
            code = int(pred.lm_head[g - 1](out[0, -1]).argmax())
            codes.append(code)
            seq = torch.cat([seq, pred.model.codec_embedding[g - 1].weight[code][None, None]], 1)
        frame = torch.tensor(codes)
        frames.append(frame)
        text = int(trailing[step]) if step < trailing.numel() else TTS_PAD
        row = (
            talker.model.codec_embedding.weight[code0]
            + sum(pred.model.codec_embedding[g - 1].weight[codes[g]] for g in range(1, GROUPS))
            + talker.text_projection(talker.model.text_embedding.weight[text])
        )
        x = torch.cat([x, row[None, None]], 1)
    return frames


@pytest.mark.anyio
async def test_checkpoint_folder_runs_as_upstream(
    tmp_path: Path, ours: TTSConfig, upstream: Any, upstream_decoder: Any, up: Any
) -> None:
    folder = _save_folder(tmp_path, ours, upstream, upstream_decoder, up)
    model = build_model("qwen3-tts", path=folder, chunk=4)
    # Our default repetition penalty is upstream's.
    default = inspect.signature(model.program).parameters["repetition_penalty"].default
    assert default == inspect.signature(upstream.generate).parameters["repetition_penalty"].default
    n = 10
    gen = torch.Generator().manual_seed(4)
    pcm = (torch.randn(24_000, generator=gen) * 0.1).clamp(-1, 1)
    runs: dict[float, list[Any]] = {}
    with anyio.fail_after(60):
        async with open_runtime(model) as runtime:
            async with runtime.generate(
                text="", ref_audio=pcm, ref_text="Hi there.", encode_only=True
            ) as out:
                (encoded,) = [v async for v in out]
            # As registered: the second and third runs resume the voice's kept prompt rows.
            voice = VoicePrompt(encoded.speaker, encoded.codes, encoded.transcript, VOICE_ID)
            for penalty in (default, 1.0, PENALTY):
                async with runtime.generate(
                    text="Hello.",
                    voice=voice,
                    max_tokens=n,
                    temperature=0,
                    subtalker_temperature=0,
                    repetition_penalty=penalty,
                    return_codes=True,
                ) as out:
                    runs[penalty] = [item async for item in out]
            talker_engine: Any = runtime.batching.engines["talker"]
            reused = talker_engine.reused_tokens
    theirs = upstream.extract_speaker_embedding(pcm.numpy(), 24_000)
    torch.testing.assert_close(voice.speaker, theirs.float(), **TOL)
    assert voice.codes is not None and voice.codes.shape == (13, GROUPS)
    spoken = {
        penalty: [i.latent.tolist() for i in items if isinstance(i, LatentOutput)]
        for penalty, items in runs.items()
    }
    # The penalty changes what is said, so each run below checks it, not a no-op.
    assert spoken[PENALTY] != spoken[1.0]
    pcm_out = torch.cat([i.pcm for i in runs[default] if isinstance(i, AudioChunk)])
    from mstar_async.models.checkpoints import ChatTokenizer
    from mstar_async.models.qwen3_tts.program import layout_for

    tokenizer = ChatTokenizer.from_folder(folder)
    prompt = layout_for(
        tokenizer,
        ours,
        IDS,
        "Hello.",
        speaker=None,
        language="auto",
        instruct="",
        voice=voice,
        streaming_text=None,
    )
    assert reused == 2 * prompt.voice_rows > 0
    with torch.inference_mode():
        talker = _talker(ours, upstream)
        rows = talker.prompt_rows(prompt.layout, voice.speaker)
        for penalty, frames in spoken.items():
            expected = _reference_frames(upstream, rows, prompt.trailing, n, penalty)
            assert frames == [f.tolist() for f in expected], penalty
        # Upstream decodes the reference codes and the generated ones as one sequence and cuts
        # the reference's audio; windows of 4 new frames with 25 of left context.
        whole = torch.cat([voice.codes, torch.tensor(spoken[default])]).T[None]
        ref = voice.codes.shape[0]
        audio = torch.cat(
            [
                upstream_decoder(whole[..., max(0, s - 25) : s + 4])[0, 0][
                    (s - max(0, s - 25)) * 1920 :
                ]
                for s in range(ref, ref + n, 4)
            ]
        )
    assert pcm_out.numel() == n * 1920
    torch.testing.assert_close(pcm_out, audio, atol=2e-4, rtol=1e-3)
