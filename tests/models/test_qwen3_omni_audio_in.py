"""Speech in for qwen3-omni: the audio encoder as a node feeding the thinker.

Against transformers: a tiny ``Qwen3OmniMoeForConditionalGeneration`` saved as a checkpoint
folder loads into the runtime (audio tower included); its thinker's logits for a prompt with
audio equal ours, and the runtime's greedy answer to a spoken turn is upstream's. In the runtime:
speech streamed in 20 ms pieces is convolved a second at a time as it arrives (exact frame
counts per step) and its rows equal the whole encoding; an answer from streamed speech equals
one from the rows an ``encode_only`` request made; bad speech is refused with the fix named,
before any encoder work; nothing is left behind on cancel.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.errors import EngineError, RequestError
from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_omni.audio_features import log_mel
from mstar_async.models.qwen3_omni.audio_prompt import audio_tokens, build_prompt
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention, seeded_init
from mstar_async.models.qwen3_omni.model import talker_tokens
from mstar_async.models.qwen3_omni.talker import talker_prompt
from mstar_async.models.qwen3_omni.thinker_engine import talker_rows, tts_rows
from mstar_async.models.qwen3_omni.weights import OmniWeights
from mstar_async.outputs import EncodedAudio, TextDelta
from mstar_async.runtime import open_runtime

hf = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
hf_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")
hf_processing = pytest.importorskip("transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe")
whisper = pytest.importorskip("transformers.models.whisper.feature_extraction_whisper")

pytestmark = pytest.mark.timeout(90)

VOCAB = 49152 + 6  # SmolLM2's vocabulary, three tts ids, three audio ids
QUESTION = "What did I say?"


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _speech(seconds: float, seed: int = 0) -> torch.Tensor:
    """A gliding tone in noise, loudest at the start (so streamed features equal whole ones:
    the running maximum is the utterance's from the first frame on)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16_000)) / 16_000
    tone = torch.sin(2 * math.pi * 180 * t * (1 + 0.5 * t)) + 0.05 * torch.randn(
        t.shape, generator=gen
    )
    return 0.4 * tone * torch.exp(-t / 3)


def _config() -> Any:
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
        },
    }
    audio = {
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "d_model": 16,
        "output_dim": 32,
        "downsample_hidden_size": 8,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "deepstack_visual_indexes": [0],
        "num_position_embeddings": 16,
    }
    names = ["codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id"]
    names += ["codec_think_bos_id", "codec_think_eos_id"]
    predictor = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_code_groups": 4,
    }
    return hf_config.Qwen3OmniMoeConfig(
        thinker_config={
            "text_config": text,
            "audio_config": audio,
            "vision_config": vision,
            "audio_start_token_id": VOCAB - 3,
            "audio_token_id": VOCAB - 2,
            # Read by upstream's rope index (no image is sent; any id the prompt lacks).
            "vision_start_token_id": 49150,
        },
        talker_config={
            "text_config": {**text, "shared_expert_intermediate_size": 24},
            "code_predictor_config": predictor,
            "num_code_groups": 4,
            "thinker_hidden_size": 32,
            "speaker_id": {"Ethan": 70},
            "spatial_merge_size": 2,
            "accept_hidden_layer": 1,  # of the thinker's 2 layers
            **{name: 64 + i for i, name in enumerate(names)},
        },
        code2wav_config={
            "codebook_size": 64,
            "num_quantizers": 4,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "decoder_dim": 16,
        },
        tts_bos_token_id=VOCAB - 6,
        tts_eos_token_id=VOCAB - 5,
        tts_pad_token_id=VOCAB - 4,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    upstream = hf.Qwen3OmniMoeForConditionalGeneration(_config()).eval()
    seeded_init(upstream, 5, skip=("thinker.audio_tower.ln_post",))
    path = tmp_path_factory.mktemp("qwen3-omni-audio")
    upstream.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder() / name, path / name)
    return upstream, path


def _upstream_inputs(pcm: torch.Tensor, tokenizer: ChatTokenizer) -> dict[str, torch.Tensor]:
    """Upstream's inputs for one user turn [audio, QUESTION]: Whisper features, their mask, and
    ids with as many audio pads as upstream's processor counts (its own length formula)."""
    features = whisper.WhisperFeatureExtractor(feature_size=128)(
        pcm.numpy(),
        sampling_rate=16_000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = features.attention_mask
    pads = int(hf_processing._get_feat_extract_output_lengths(mask.sum(-1), 50)[0])
    head, tail = tokenizer.apply_chat_template(
        [{"role": "user", "content": "@@" + QUESTION}]
    ).split("@@")
    ids = tokenizer.encode(head) + [VOCAB - 3] + [VOCAB - 2] * pads + [VOCAB - 1]
    ids += tokenizer.encode(tail)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "input_features": features.input_features,
        "feature_attention_mask": mask,
    }


def test_thinker_logits_with_audio_match_upstream(folder: tuple[Any, Path]) -> None:
    upstream, path = folder
    tokenizer = ChatTokenizer.from_folder(path)
    pcm = _speech(2.37)  # 237 frames: two full chunks and a 37-frame tail
    inputs = _upstream_inputs(pcm, tokenizer)
    model = build_model("qwen3-omni", path=path)
    weights: OmniWeights = model.components["thinker"].args[0]
    thinker, encoder = weights.thinker(), weights.audio_encoder()
    ids = audio_tokens(VOCAB - 3, VOCAB - 2, None, tokenizer)
    (rows,) = encoder([log_mel(pcm)])
    prompt = build_prompt(
        tokenizer, ids, [{"role": "user", "content": QUESTION, "audio": pcm}], [rows.shape[0]]
    )
    assert prompt.ids == inputs["input_ids"][0].tolist()  # the same layout and pad count
    assert rows.shape[0] == 31  # 13 + 13 + 5 for 237 frames
    at = torch.arange(rows.shape[0]) + prompt.audio_at[0]
    with torch.no_grad():
        want = upstream.thinker(**inputs).logits[0]
        hidden = thinker(
            torch.tensor(prompt.ids), DenseCausalAttention(len(prompt.ids)), embeds=(at, rows)
        )
        got = thinker.compute_logits(hidden)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Every position after the audio depends on it: without the rows the logits differ there.
    with torch.no_grad():
        deaf = thinker.compute_logits(
            thinker(torch.tensor(prompt.ids), DenseCausalAttention(len(prompt.ids)))
        )
    assert float((deaf[-1] - want[-1]).abs().max()) > 1e-2


def test_the_talker_reads_audio_positions_through_the_thinkers_hidden_rows_as_upstream(
    folder: tuple[Any, Path],
) -> None:
    upstream, path = folder
    tokenizer = ChatTokenizer.from_folder(path)
    pcm = _speech(1.37)
    inputs = _upstream_inputs(pcm, tokenizer)
    weights: OmniWeights = build_model("qwen3-omni", path=path).components["thinker"].args[0]
    thinker, encoder = weights.thinker(), weights.audio_encoder()
    (rows,) = encoder([log_mel(pcm)])
    ids = audio_tokens(VOCAB - 3, VOCAB - 2, None, tokenizer)
    turn = [{"role": "user", "content": QUESTION, "audio": pcm}]
    prompt = build_prompt(tokenizer, ids, turn, [rows.shape[0]])
    at = torch.arange(rows.shape[0]) + prompt.audio_at[0]
    layer = upstream.config.talker_config.accept_hidden_layer
    with torch.no_grad():
        states = upstream.thinker(**inputs, output_hidden_states=True).hidden_states
        thinker(torch.tensor(prompt.ids), DenseCausalAttention(len(prompt.ids)), embeds=(at, rows))
        heard = thinker.take_embeds_out()
        assert heard is not None
        torch.testing.assert_close(heard, states[layer][0, at], atol=1e-5, rtol=1e-5)
        # Upstream's user part of the talker's input: text_projection of the embeddings, and
        # hidden_projection of the layer's rows at the audio positions.
        mask = inputs["input_ids"] == VOCAB - 2
        length = len(prompt.ids)
        whole = upstream._get_talker_user_parts(0, length, mask, states[layer], states[0])[0]
        tokens = talker_tokens(weights.config, tokenizer, VOCAB - 2)
        starts = [i for i, t in enumerate(prompt.ids) if t == tokens.im_start] + [length]
        user = [
            p
            for s, e in itertools.pairwise(starts)
            if prompt.ids[s + 1] == tokens.user
            for p in range(s, e)
        ]
        speaker = next(iter(tokens.speakers.values()))
        # What the thinker's engine sends: its embedding rows of the user turns' text and the
        # header (not of the audio placeholders), of the first token and of the tts specials.
        table = thinker.embed_tokens.weight
        text = talker_rows(table, prompt.ids, tokens)
        assert text is not None and text.shape[0] == len(prompt.ids) - len(at) - user[0]
        spoken = (torch.tensor(prompt.ids), text, table[5], tts_rows(table, tokens), speaker)
        ours = talker_prompt(weights.talker(), tokens, *spoken, heard)
    torch.testing.assert_close(ours[: len(user)], whole[user], atol=1e-5, rtol=1e-5)
    # Without the thinker's rows the prompt is refused, not silently read as text.
    with pytest.raises(EngineError, match="audio positions"):
        talker_prompt(weights.talker(), tokens, *spoken)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_a_spoken_turn_is_answered_as_upstream_answers_it(folder: tuple[Any, Path]) -> None:
    upstream, path = folder
    tokenizer = ChatTokenizer.from_folder(path)
    pcm = _speech(1.6)
    inputs = _upstream_inputs(pcm, tokenizer)
    ids = inputs.pop("input_ids")[0].tolist()
    with torch.no_grad():
        for _ in range(8):
            logits = upstream.thinker(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                **{k: v for k, v in inputs.items() if k != "attention_mask"},
            ).logits
            ids.append(int(logits[0, -1].argmax()))
    model = build_model("qwen3-omni", path=path)
    async with open_runtime(model) as runtime:
        with anyio.fail_after(60):
            message = {"role": "user", "content": QUESTION, "audio": pcm}
            async with runtime.generate(
                messages=[message], max_tokens=8, speak=False, ignore_eos=True
            ) as outputs:
                text = "".join([o.text async for o in outputs if isinstance(o, TextDelta)])
    assert text == tokenizer.decode(ids[-8:])


async def _pieces(pcm: torch.Tensor, size: int) -> AsyncIterator[torch.Tensor]:
    for start in range(0, pcm.numel(), size):
        yield pcm[start : start + size]


def _frames_after(samples: int) -> int:
    """Mel frames convolved once ``samples`` are in (mid-stream): frame t is out at sample
    160 t + 200, and a 100-frame chunk is convolved once its last frame is."""
    out = (samples - 200) // 160 + 1 if samples > 200 else 0
    return out // 100 * 100


@pytest.mark.anyio
async def test_streamed_speech_is_convolved_as_it_arrives_and_equals_the_whole() -> None:
    pcm = _speech(2.5)
    model = build_model("qwen3-omni")
    async with open_runtime(model) as runtime:
        with anyio.fail_after(60):
            async with runtime.generate(audio=_pieces(pcm, 320), encode_only=True) as outputs:
                heard = [o async for o in outputs]
        engine = runtime.batching.engines["audio"]
        assert engine.streams == 0 and runtime.batching.kv_blocks_in_use == 0
    assert all(isinstance(o, EncodedAudio) for o in heard)
    # One step per 100 ms of speech (1600 samples) and one for the end.
    assert len(heard) == 40000 // 1600 + 1
    progress = [o.frames for o in heard[:-1]]
    assert progress == [_frames_after(1600 * (k + 1)) for k in range(len(progress))]
    assert progress[10] == 100 and progress[20] == 200  # a second's chunk, 100 ms after it
    assert heard[-1].frames == 250 and heard[-1].samples == 40000
    rows = torch.cat([o.rows for o in heard])
    weights: OmniWeights = model.components["audio"].args[0]
    (whole,) = weights.audio_encoder()([log_mel(pcm)])
    assert rows.shape == whole.shape == (13 + 13 + 7, 64)
    torch.testing.assert_close(rows, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.anyio
async def test_an_answer_from_streamed_speech_equals_one_from_its_encoded_rows() -> None:
    pcm = _speech(1.3, seed=2)
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        with anyio.fail_after(60):
            async with runtime.generate(audio=_pieces(pcm, 480), encode_only=True) as outputs:
                rows = torch.cat([o.rows async for o in outputs])
            answers = []
            for inputs in (
                {"audio": _pieces(pcm, 480), "text": QUESTION},
                {"messages": [{"role": "user", "content": QUESTION, "audio": rows}]},
            ):
                async with runtime.generate(**inputs, max_tokens=6, speak=False) as outputs:
                    answers.append([o.text async for o in outputs if isinstance(o, TextDelta)])
            assert runtime.batching.kv_blocks_in_use == 0
    assert answers[0] == answers[1] and answers[0]


@pytest.mark.anyio
async def test_bad_speech_is_refused_with_the_fix_before_any_encoder_work() -> None:
    model = build_model("qwen3-omni", max_audio_seconds=1.0)
    long = _speech(1.5)
    cases = [
        ({"audio": long, "audio_rate": 24_000}, "16000 Hz"),
        ({"audio": long}, "at most 1 s"),
        ({"audio": long[:100]}, "at least 201 samples"),
        ({"audio": long[None, :640]}, "encoded audio must be rows"),
        ({"audio": (long * 100).long()}, r"float in \[-1, 1\] or int16"),
    ]
    async with open_runtime(model) as runtime:
        engine = runtime.batching.engines["audio"]
        for extra, message in cases:
            with anyio.fail_after(30), pytest.raises(RequestError, match=message):
                turn = {"role": "user", "content": "hi", **extra}
                async with runtime.generate(messages=[turn], speak=False) as outputs:
                    [o async for o in outputs]
        assert runtime.batching.stats.steps == 0  # nothing reached an engine
        # A stream that runs past the limit fails at the chunk that passes it, and leaves
        # nothing behind.
        with anyio.fail_after(30), pytest.raises(RequestError, match="at most 1 s"):
            async with runtime.generate(audio=_pieces(long, 800), encode_only=True) as outputs:
                [o async for o in outputs]
        assert engine.streams == 0 and runtime.batching.kv_blocks_in_use == 0


@pytest.mark.anyio
async def test_leaving_mid_utterance_frees_the_encoders_state() -> None:
    async def endless() -> AsyncIterator[torch.Tensor]:
        while True:
            yield _speech(0.1)

    async with open_runtime(build_model("qwen3-omni")) as runtime:
        engine = runtime.batching.engines["audio"]
        with anyio.fail_after(30):
            async with runtime.generate(audio=endless(), encode_only=True) as outputs:
                async for piece in outputs:
                    if piece.frames >= 100:
                        break
                assert engine.streams == 1
            assert engine.streams == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_a_checkpoint_whose_audio_ids_it_cannot_embed_is_served_deaf(
    folder: tuple[Any, Path], tmp_path: Path
) -> None:
    _, path = folder
    for file in path.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((path / "config.json").read_text())
    config["thinker_config"]["audio_token_id"] = 151_646  # transformers' default, past VOCAB
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model("qwen3-omni", path=tmp_path)
    assert model.info["audio_input_rate"] == 0 and "audio" not in model.components
    async with open_runtime(model) as runtime:
        turn = {"role": "user", "content": "hi", "audio": _speech(0.5)}
        with anyio.fail_after(30), pytest.raises(RequestError, match="outside the thinker's"):
            async with runtime.generate(messages=[turn], speak=False) as outputs:
                [o async for o in outputs]
        assert runtime.batching.stats.steps == 0
