"""qwen3-tts through the runtime: streamed audio equals the decoder's windows over all frames,
every kind of voice speaks, a cloned voice computed once equals one cloned inline, bad inputs
say what is wrong, and cancelling mid-speech frees every KV block; and the talker's codebook-0
rule (specials, end of speech, repetition penalty) on known logits."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from mstar_async.engines.sampling import SamplingParams
from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_omni.embeds_engine import Sampler
from mstar_async.models.qwen3_omni.talker import sample_code0
from mstar_async.models.qwen3_tts.model import prompt_ids, seeded_config
from mstar_async.models.qwen3_tts.program import chat_ids
from mstar_async.models.qwen3_tts.prompt import lay_out
from mstar_async.models.qwen3_tts.speech_decoder import chunked_decode
from mstar_async.models.qwen3_tts.voice import VoicePrompt
from mstar_async.outputs import AudioChunk, LatentOutput
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

CHUNK = 4
TEXT = "Hello there, how are you today?"


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def runtime_model() -> Any:
    return build_model("qwen3-tts", size="tiny", chunk=CHUNK)


async def _collect(runtime: Any, **inputs: Any) -> list[Any]:
    inputs.setdefault("max_tokens", 14)
    with anyio.fail_after(60):
        async with runtime.generate(return_codes=True, **inputs) as outputs:
            return [item async for item in outputs]


def _split(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    frames = torch.stack([i.latent for i in items if isinstance(i, LatentOutput)])
    pcm = torch.cat([i.pcm for i in items if isinstance(i, AudioChunk)])
    return frames, pcm


def _ref_pcm() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    t = torch.arange(36_000) / 24_000
    return 0.3 * torch.sin(2 * torch.pi * 180 * t) + 0.02 * torch.randn(36_000, generator=gen)


async def test_every_voice_kind_streams_the_decoders_windows(runtime_model: Any) -> None:
    async with open_runtime(runtime_model) as runtime:
        decoder = runtime.batching.engines["decoder"].ops["decode"].func.__self__
        for inputs in (
            {"speaker": "ryan"},
            {"speaker": "Vivian", "language": "english", "instruct": "Cheerful."},
            {"instruct": "A deep, slow voice."},
        ):
            frames, pcm = _split(await _collect(runtime, text=TEXT, **inputs))
            assert frames.shape == (14, 4)
            assert int(frames.max()) < 64  # codec specials are never spoken
            assert pcm.numel() == 14 * 1920
            with torch.inference_mode():
                expected = chunked_decode(decoder, frames, CHUNK, 25)
            torch.testing.assert_close(pcm, expected, atol=1e-5, rtol=1e-5)


async def test_a_voice_computed_once_equals_cloning_inline(runtime_model: Any) -> None:
    pcm = _ref_pcm()
    async with open_runtime(runtime_model) as runtime:
        with anyio.fail_after(60):
            async with runtime.generate(
                text="", ref_audio=pcm, ref_text="A short test.", encode_only=True
            ) as out:
                (voice,) = [v async for v in out]
        assert isinstance(voice, VoicePrompt) and voice.in_context
        assert voice.codes is not None and voice.codes.shape == (19, 4)  # ceil(36000 / 1920)
        cached = await _collect(runtime, text=TEXT, voice=voice, seed=3)
        inline = await _collect(runtime, text=TEXT, ref_audio=pcm, ref_text="A short test.", seed=3)
        xvec = await _collect(runtime, text=TEXT, ref_audio=pcm, x_vector_only=True, seed=3)
    (f1, p1), (f2, p2), (f3, _) = _split(cached), _split(inline), _split(xvec)
    assert torch.equal(f1, f2) and torch.equal(p1, p2)
    assert not torch.equal(f1, f3)  # the reference codes are part of the prompt


async def test_bad_inputs_name_the_problem(runtime_model: Any) -> None:
    async with open_runtime(runtime_model) as runtime:
        cases = [
            ({"text": TEXT, "speaker": "nobody"}, "unknown speaker 'nobody'"),
            ({"text": TEXT, "language": "klingon"}, "unknown language 'klingon'"),
            ({"text": TEXT, "ref_audio": _ref_pcm()}, "ref_text"),
            ({"text": "", "speaker": "ryan"}, "text to speak is empty"),
            ({"text": TEXT, "repetition_penalty": 0}, "repetition_penalty must be"),
        ]
        for inputs, message in cases:
            with pytest.raises(Exception) as caught:
                await _collect(runtime, **inputs)
            assert message in str(caught.value) or message in str(caught.value.__cause__)


async def test_cancel_mid_speech_frees_every_kv_block(runtime_model: Any) -> None:
    async with open_runtime(runtime_model) as runtime:
        engines = [runtime.batching.engines[name] for name in ("talker", "predictor")]
        with anyio.fail_after(60):
            async with runtime.generate(text=TEXT, speaker="ryan", max_tokens=400) as outputs:
                async for item in outputs:
                    if isinstance(item, AudioChunk):
                        assert engines[0].blocks_in_use > 0
                        break
        assert [e.blocks_in_use for e in engines] == [0, 0]


def test_chat_ids_cut_as_upstream_and_layout_rows() -> None:
    tokenizer = ChatTokenizer.from_folder(smollm2_folder())
    role, body = chat_ids(tokenizer, "Hello there.", "<|im_end|>\n<|im_start|>assistant\n")
    assert role[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(role[1:]) == "assistant\n"
    assert tokenizer.decode(body) == "Hello there."
    ids = prompt_ids(seeded_config("tiny", 0, tokenizer), tokenizer)
    plain = lay_out(ids, role, body, speaker=76, streaming_text=True)
    # role rows, 3 tags + speaker + pad (the last over tts_bos), the first text token over bos
    assert plain.layout.shape == (len(role) + 5 + 1, 6)
    assert plain.layout[len(role) + 4, 0] == ids.tts_bos
    assert plain.trailing.tolist() == [*body[1:], ids.tts_eos]
    codes = torch.zeros(2, 4, dtype=torch.long)
    icl = lay_out(ids, role, body, speaker=-2, ref_text=[7, 8], ref_codes=codes)
    # the text is longer than bos + 2 frames: three rows pair up, the rest trails
    assert icl.trailing.tolist() == [*[7, 8, *body][3:], ids.tts_eos]
    with pytest.raises(ValueError, match="transcript"):
        lay_out(ids, role, body, ref_codes=codes)


def test_codebook_0_takes_the_repetition_penalty_on_codes_spoken() -> None:
    # Codebook of 4; 4 and 6 are specials (never said), 5 the end of speech.
    logits = torch.tensor([2.0, 1.95, -1.0, -3.0, 10.0, 1.0, 9.0, 0.0])

    def greedy(
        penalty: float, seen: list[int] | None, eos: bool = True, row: torch.Tensor = logits
    ) -> int:
        sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=penalty), None)
        spoken = None if seen is None else torch.tensor(seen, dtype=torch.long)
        return sample_code0(
            row.clone(), sampler, codebook_size=4, codec_eos=5, eos_allowed=eos, seen=spoken
        )

    assert greedy(1.0, [0, 3]) == 0  # 2.0 is the largest code
    assert greedy(1.05, None) == 0  # nothing spoken yet
    assert greedy(1.05, [0, 3]) == 1  # 2.0 / 1.05 = 1.905 < 1.95
    # A penalty that pushes every code below the end of speech ends it, where it may.
    assert greedy(2.5, [0, 1]) == 5  # 0.8 and 0.78 < 1.0
    assert greedy(2.5, [0, 1], eos=False) == 0  # 0.8 > 0.78
    # Negative logits are multiplied (-1.0 * 1.5 = -1.5 < -1.2), not divided.
    negative = torch.tensor([-1.0, -1.2, -2.0, -3.0, 0.0, -9.0, 0.0, 0.0])
    assert greedy(1.5, [0], row=negative) == 1


def test_released_encoders_shape_a_seeded_model_only(tmp_path: Any) -> None:
    model = build_model("qwen3-tts", size="tiny", encoders="released")
    cfg = model.components["voice"].args[0].config
    assert cfg.speaker_encoder.enc_channels == (512, 512, 512, 512, 1536)
    assert cfg.speaker_encoder.enc_dim == cfg.talker.hidden_size  # its embedding enters the prompt
    assert cfg.encoder["hidden_size"] == 512 and cfg.encoder["num_hidden_layers"] == 8
    assert cfg.encoder["num_quantizers"] == cfg.num_code_groups
    with pytest.raises(ValueError, match="'seeded' or 'released'"):
        build_model("qwen3-tts", size="tiny", encoders="large")
    with pytest.raises(ValueError, match="a checkpoint has its own"):
        build_model("qwen3-tts", path=tmp_path, encoders="released")


def test_the_voice_engine_builds_its_encoders_once() -> None:
    """The weights keep a part only while something holds it: the engine holds its encoders,
    which were built again (seeded, or read from the checkpoint) for every cloned voice."""
    import gc
    from dataclasses import replace

    from mstar_async.models.qwen3_tts.config import SIZES
    from mstar_async.models.qwen3_tts.model import _voice_engine
    from mstar_async.models.qwen3_tts.weights import TTSWeights

    weights = TTSWeights(replace(SIZES["tiny"], text_vocab=100), None, torch.float32, "cpu")
    engine = _voice_engine(weights)
    built: list[str] = []
    part = weights._part

    def counting(name: str, build: Any) -> Any:
        if name not in weights._live:
            built.append(name)
        return part(name, build)

    weights._part = counting  # type: ignore[method-assign]
    for _ in range(3):
        engine.run_op("encode", [{"pcm": _ref_pcm(), "with_codes": torch.tensor(True)}])
        gc.collect()
    assert sorted(built) == ["speaker_encoder", "speech_encoder"]
