"""qwen3-omni through the runtime: text and audio interleaved, streaming equals batch decoding,
audio length, the graph's nesting, a dense reference of the whole data flow, and cancellation."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
import torch

from mstar_async.graph import DynamicLoop, Loop, Sequential
from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_omni.code2wav import chunked_decode
from mstar_async.models.qwen3_omni.decoder import DenseCausalAttention
from mstar_async.models.qwen3_omni.model import seeded_config, talker_tokens
from mstar_async.models.qwen3_omni.talker import (
    REPETITION_PENALTY,
    TTS_EOS,
    TTS_PAD,
    TalkerTokens,
    talker_prompt,
)
from mstar_async.models.qwen3_omni.thinker_engine import talker_rows, tts_rows
from mstar_async.models.qwen3_omni.weights import OmniWeights
from mstar_async.outputs import AudioChunk, LatentOutput, TextDelta
from mstar_async.runtime import open_runtime

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

CHUNK = 4
PROMPT = "Say something about the sea."


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_folder(smollm2_folder())


def _model(**options: Any) -> Any:
    return build_model("qwen3-omni", size="tiny", chunk=CHUNK, left_context=CHUNK, **options)


def _parts(tokenizer: ChatTokenizer) -> tuple[OmniWeights, TalkerTokens]:
    cfg = seeded_config("tiny", 0, tokenizer)
    return OmniWeights(cfg, None, torch.float32, "cpu"), talker_tokens(cfg, tokenizer)


async def _collect(runtime: Any, **inputs: Any) -> list[Any]:
    # Greedy speech from random weights rarely ends by itself: bound it.
    inputs.setdefault("max_frames", 24)
    with anyio.fail_after(60):
        async with runtime.generate(**inputs) as outputs:
            return [item async for item in outputs]


GREEDY = {"temperature": 0.0, "voice_temperature": 0.0, "ignore_eos": True}


async def test_text_streams_while_audio_chunks_arrive() -> None:
    async with open_runtime(_model()) as runtime:
        out = await _collect(runtime, text=PROMPT, max_tokens=32, **GREEDY)
    kinds = ["T" if isinstance(o, TextDelta) else "A" for o in out]
    audio = [o for o in out if isinstance(o, AudioChunk)]
    assert len(audio) >= 2
    assert all(a.sample_rate == 24_000 and a.pcm.dtype == torch.float32 for a in audio)
    # The first audio chunk comes before the last text delta: speech starts while the thinker
    # is still writing, and text is streamed before the last audio chunk.
    assert kinds.index("A") < len(kinds) - 1 - kinds[::-1].index("T")
    assert kinds.index("T") < len(kinds) - 1 - kinds[::-1].index("A")
    assert all(a.pcm.abs().max() <= 1.0 for a in audio)


async def test_streamed_pcm_equals_decoding_all_frames_at_once_on_one_grid(
    tokenizer: ChatTokenizer,
) -> None:
    max_tokens = 15
    async with open_runtime(_model()) as runtime:
        out = await _collect(
            runtime, text=PROMPT, max_tokens=max_tokens, max_frames=25, return_codes=True, **GREEDY
        )
    frames = torch.stack([o.latent for o in out if isinstance(o, LatentOutput)])
    assert [o.step for o in out if isinstance(o, LatentOutput)] == list(range(len(frames)))
    pcm = torch.cat([o.pcm for o in out if isinstance(o, AudioChunk)])
    parts, _ = _parts(tokenizer)
    code2wav = parts.code2wav()
    # One frame per text token after the prefill's (ignore_eos: max_tokens - 1), and the talker
    # speaks on after the text, in the same walk.
    assert len(frames) > max_tokens - 1, "the talker should speak on after the text"
    with torch.inference_mode():
        whole = chunked_decode(code2wav, frames, CHUNK, CHUNK)
        one = code2wav(frames[:1].T)
    # One uninterrupted grid of CHUNK-frame windows, wherever the text ended.
    torch.testing.assert_close(pcm, whole, atol=1e-5, rtol=1e-5)
    # Audio length follows the frame count: total_upsample samples per frame, less the fixed
    # tail each causal decode drops (as upstream's chunked decode).
    upsample = code2wav.config.total_upsample
    chunks = math.ceil(len(frames) / CHUNK)
    assert len([o for o in out if isinstance(o, AudioChunk)]) == chunks
    assert pcm.numel() == len(frames) * upsample - (upsample - one.numel()) * chunks


def _reference(
    parts: OmniWeights,
    tokens: TalkerTokens,
    ids: list[int],
    max_tokens: int,
    speaker: int,
    max_frames: int,
    penalty: float,
) -> tuple[list[int], list[list[int]]]:
    """The whole greedy data flow, sequentially, on dense attention recomputed every step;
    codebook 0 takes transformers' repetition ``penalty`` over codebook 0 of the frames so
    far."""
    thinker, talker = parts.thinker(), parts.talker()
    predictor = talker.code_predictor
    text: list[int] = []
    for _ in range(max_tokens):
        seq = torch.tensor(ids + text)
        hidden = thinker(seq, DenseCausalAttention(len(seq)))
        text.append(int(thinker.compute_logits(hidden[-1]).argmax()))

    def code0(h: torch.Tensor, frames: list[list[int]]) -> int:
        logits = talker.codec_head(h)
        seen = torch.tensor(sorted({f[0] for f in frames}), dtype=torch.long)
        x = logits[seen]
        logits[seen] = torch.where(x < 0, x * penalty, x / penalty)
        logits[tokens.codebook_size :] = float("-inf")
        logits[tokens.codec_eos] = talker.codec_head(h)[tokens.codec_eos]
        return int(logits.argmax())

    # The thinker's input embeddings, as upstream's talker reads them (hidden_states[0]).
    table = thinker.embed_tokens.weight
    tts = tts_rows(table, tokens)
    prompt_rows = talker_rows(table, ids, tokens)
    rows = talker_prompt(
        talker, tokens, torch.tensor(ids), prompt_rows, table[text[0]], tts, speaker
    )
    hidden = talker.model(rows, DenseCausalAttention(len(rows)))[-1]
    frames: list[list[int]] = []
    code = code0(hidden, frames)
    # Upstream's trailing text: the tokens after the first, one per frame, tts_eos in place of
    # the last, then tts_pad.
    feed = [*(table[t] for t in text[1:-1]), tts[TTS_EOS]]
    while len(frames) < max_frames:
        text_row = feed[len(frames)] if len(frames) < len(feed) else tts[TTS_PAD]
        cp_rows = [hidden, talker.model.codec_embedding.weight[code]]
        codes: list[int] = []
        for group in range(talker.groups - 1):
            h = predictor.model(torch.stack(cp_rows), DenseCausalAttention(len(cp_rows)))[-1]
            codes.append(int(predictor.lm_head[group](h).argmax()))
            cp_rows.append(predictor.embed(group + 1, codes[-1]))
        frame = [code, *codes]
        frames.append(frame)
        row = talker.frame_embedding(torch.tensor(frame)) + talker.text_projection(text_row)
        rows = torch.cat([rows, row[None]])
        hidden = talker.model(rows, DenseCausalAttention(len(rows)))[-1]
        code = code0(hidden, frames)
        if code == tokens.codec_eos:
            break
    return text, frames


async def test_runtime_matches_a_dense_sequential_reference(tokenizer: ChatTokenizer) -> None:
    max_tokens, max_frames = 10, 16
    penalties = (REPETITION_PENALTY, 1.0, 3.0)  # upstream's default, none, a strong one
    spoken: dict[float, list[list[int]]] = {}
    async with open_runtime(_model()) as runtime:
        for penalty in penalties:
            out = await _collect(
                runtime,
                text=PROMPT,
                max_tokens=max_tokens,
                max_frames=max_frames,
                return_codes=True,
                repetition_penalty=penalty,
                **GREEDY,
            )
            spoken[penalty] = [o.latent.tolist() for o in out if isinstance(o, LatentOutput)]
    parts, tokens = _parts(tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    # The penalty changes what is said, so the comparisons below check it, not a no-op.
    assert spoken[3.0] != spoken[1.0]
    for penalty, frames in spoken.items():
        with torch.inference_mode():
            text, want = _reference(
                parts,
                tokens,
                tokenizer.encode(prompt),
                max_tokens,
                tokens.speakers["ethan"],
                max_frames,
                penalty,
            )
        assert frames == want, penalty
        assert max_tokens - 1 < len(frames) <= max_frames  # the talker spoke on after the text
    assert "".join(o.text for o in out if isinstance(o, TextDelta)) == tokenizer.decode(text)


def test_the_thinker_sends_its_rows_and_the_talker_refuses_rows_that_do_not_fit(
    tokenizer: ChatTokenizer,
) -> None:
    from mstar_async.engines.base import Step
    from mstar_async.errors import EngineError

    parts, tokens = _parts(tokenizer)
    table, talker = parts.thinker().embed_tokens.weight, parts.talker()
    thinker = _model().components["thinker"]()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    prompts = [torch.tensor(tokenizer.encode(text)) for text in (chat, PROMPT)]
    spoken, plain = (
        thinker.forward([Step(f"r{i}", "prefill", {"tokens": p})])[0] for i, p in enumerate(prompts)
    )
    assert isinstance(spoken, dict) and isinstance(plain, dict)
    # The rows of the user turn and the header, of the sampled token, of the tts specials.
    assert torch.equal(spoken["rows"], talker_rows(table, prompts[0], tokens))
    assert torch.equal(spoken["row"], table[spoken["token"]])
    assert torch.equal(spoken["tts"], tts_rows(table, tokens))
    decoded = thinker.forward([Step("r0", "decode", {"token": spoken["token"]})])[0]
    assert isinstance(decoded, dict) and torch.equal(decoded["row"], table[decoded["token"]])
    # A prompt without an assistant header is answered, and only the talker refuses it.
    assert plain["rows"] is None and plain["token"].numel() == 1
    speaker = tokens.speakers["ethan"]
    with pytest.raises(EngineError, match="assistant header"):
        talker_prompt(talker, tokens, prompts[1], None, plain["row"], plain["tts"], speaker)
    with pytest.raises(EngineError, match="embedding rows at"):
        talker_prompt(
            talker, tokens, prompts[0], spoken["rows"][1:], spoken["row"], spoken["tts"], speaker
        )


async def test_text_only_request_makes_the_same_text_and_no_audio() -> None:
    async with open_runtime(_model()) as runtime:
        spoken = await _collect(runtime, text=PROMPT, max_tokens=8, **GREEDY)
        silent = await _collect(runtime, text=PROMPT, max_tokens=8, speak=False, **GREEDY)
    assert not any(isinstance(o, AudioChunk) for o in silent)
    text = ["".join(o.text for o in out if isinstance(o, TextDelta)) for out in (spoken, silent)]
    assert text[0] == text[1] and text[0]


async def test_concurrent_requests_match_requests_alone() -> None:
    texts = [PROMPT, "What is a prime number?"]
    async with open_runtime(_model()) as runtime:
        alone = [
            await _collect(runtime, text=t, max_tokens=9, return_codes=True, **GREEDY)
            for t in texts
        ]
        together: dict[int, list[Any]] = {}

        async def one(i: int) -> None:
            together[i] = await _collect(
                runtime, text=texts[i], max_tokens=9, return_codes=True, **GREEDY
            )

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)

    def frames(out: list[Any]) -> list[list[int]]:
        return [o.latent.tolist() for o in out if isinstance(o, LatentOutput)]

    for i in range(len(texts)):
        assert frames(together[i]) == frames(alone[i])
        pcm = [
            torch.cat([o.pcm for o in out if isinstance(o, AudioChunk)])
            for out in (together[i], alone[i])
        ]
        torch.testing.assert_close(pcm[0], pcm[1], atol=1e-5, rtol=1e-5)


async def test_cancel_and_finish_free_every_kv_block() -> None:
    async with open_runtime(_model()) as runtime:
        engines = [runtime.batching.engines[name] for name in ("thinker", "talker", "predictor")]
        await _collect(runtime, text=PROMPT, max_tokens=6, **GREEDY)
        assert [e.blocks_in_use for e in engines] == [0, 0, 0]
        with anyio.fail_after(60):
            async with runtime.generate(text=PROMPT, max_tokens=400, **GREEDY) as outputs:
                async for item in outputs:
                    if isinstance(item, AudioChunk):
                        assert engines[0].blocks_in_use > 0 and engines[1].blocks_in_use > 0
                        break
        assert [e.blocks_in_use for e in engines] == [0, 0, 0]


def test_graph_nests_the_code_predictor_loop_inside_the_talker_loop() -> None:
    model = _model()
    walks = model.walks
    assert set(walks) == {
        *("listen", "hear", "prefill", "text", "voice", "speak"),
        *("keep", "forget", "rewind", "rewind_voice"),
    }
    speak = walks["speak"].body
    assert isinstance(speak, Sequential)
    thinker, frames, _ = speak.children
    assert isinstance(thinker, DynamicLoop) and isinstance(frames, DynamicLoop)
    assert not thinker.outlives_streams and frames.outlives_streams  # speech goes on after text
    assert isinstance(frames.body, Sequential)
    inner = frames.body.children[1]
    assert isinstance(inner, Loop) and inner.iterations == 2  # codebooks 2 and 3 of 4


async def test_bad_inputs_name_the_problem() -> None:
    async with open_runtime(_model()) as runtime:
        with pytest.raises(Exception, match="unknown speaker"):
            await _collect(runtime, text=PROMPT, speaker="nobody")
    with pytest.raises(ValueError, match="unknown size"):
        build_model("qwen3-omni", size="huge")


def test_embeds_engine_waits_for_memory_fails_what_never_fits_and_frees_on_release(
    tokenizer: ChatTokenizer,
) -> None:
    from mstar_async.engines.base import WAIT, Step
    from mstar_async.errors import KVCacheFull
    from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine
    from mstar_async.models.qwen3_omni.talker import predictor_ops

    parts, _ = _parts(tokenizer)
    predictor = parts.code_predictor()
    cfg = predictor.model.config
    engine = EmbedsKVEngine(
        predictor.model,
        cfg.attention_spec(torch.float32),
        predictor_ops(predictor),
        num_layers=cfg.num_hidden_layers,
        num_blocks=1,
        block_size=2,
    )
    context = torch.randn(2, cfg.hidden_size)
    first = engine.forward([Step("a", "prefill", {"context": context})])[0]
    assert isinstance(first, dict) and first["codes"].tolist() == [int(first["code"])]
    assert engine.blocks_in_use == 1
    # A second request waits for a's block; a third row of a could never fit.
    late = engine.forward(
        [
            Step("b", "prefill", {"context": context}),
            Step("a", "decode", {"code": first["code"], "codes": first["codes"]}),
        ]
    )
    assert late[0] is WAIT
    assert isinstance(late[1], KVCacheFull) and "needs KV for 3 tokens" in str(late[1])
    # A fresh prefill of the same request drops its old sequence first.
    again = engine.forward([Step("a", "prefill", {"context": context})])[0]
    assert isinstance(again, dict) and engine.blocks_in_use == 1
    engine.release("a")
    engine.release("b")
    assert engine.blocks_in_use == 0


def test_embeds_engine_splits_a_step_by_budget_and_moves_a_request_between_engines(
    tokenizer: ChatTokenizer,
) -> None:
    from mstar_async.engines.base import Step
    from mstar_async.models.qwen3_omni.embeds_engine import EmbedsKVEngine
    from mstar_async.models.qwen3_omni.talker import predictor_ops

    parts, _ = _parts(tokenizer)
    predictor = parts.code_predictor()
    cfg = predictor.model.config

    def engine() -> EmbedsKVEngine:
        return EmbedsKVEngine(
            predictor.model,
            cfg.attention_spec(torch.float32),
            predictor_ops(predictor),
            num_layers=cfg.num_hidden_layers,
            num_blocks=4,
            block_size=2,
        )

    context = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = engine()
    first = whole.forward([Step("a", "prefill", {"context": context})])[0]
    assert isinstance(first, dict)
    decode = {"code": first["code"], "codes": first["codes"]}
    expected = whole.forward([Step("a", "decode", decode)])[0]
    # The same prefill one row per forward: it comes back once, then gives the same code.
    split = engine()
    step = Step("a", "prefill", {"context": context})
    assert split.cost(step) == 2
    step.budget = 1
    assert split.forward([step]) == [None] and split.cost(step) == 1
    again = split.forward([step])[0]
    assert isinstance(again, dict) and torch.equal(again["codes"], first["codes"])
    # Its KV and generator move to another engine, which decodes as the first one did.
    state = split.export_state("a")
    assert split.blocks_in_use > 0  # held until released, once the state has arrived
    split.release("a")
    assert split.blocks_in_use == 0 and split.export_state("a") is None
    target = engine()
    target.import_state("a", state)
    moved = target.forward([Step("a", "decode", decode)])[0]
    assert isinstance(moved, dict) and isinstance(expected, dict)
    assert torch.equal(moved["codes"], expected["codes"])
    target.release("a")
    assert target.blocks_in_use == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("max_tokens", [None, 256])
async def test_a_story_finishes_with_audio_at_the_default_and_a_long_max_tokens(
    max_tokens: int | None,
) -> None:
    # The command the README gives once sat idle after its text, with no audio and no error.
    inputs: dict[str, Any] = {"text": "Tell me a story"}
    if max_tokens is not None:
        inputs["max_tokens"] = max_tokens
    async with open_runtime(build_model("qwen3-omni")) as runtime:
        with anyio.fail_after(180):
            async with runtime.generate(**inputs) as stream:  # no max_frames: as the CLI runs
                outputs = [item async for item in stream]
    audio = [o for o in outputs if isinstance(o, AudioChunk)]
    assert audio and sum(len(a.pcm) for a in audio) > 0
    assert any(isinstance(o, TextDelta) for o in outputs)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_seeded_audio_is_at_a_sane_level_not_clipped_noise(
    size: str, tokenizer: ChatTokenizer
) -> None:
    code2wav = OmniWeights(seeded_config(size, 0, tokenizer), None, torch.float32, "cpu").code2wav()
    codes = torch.randint(
        0,
        code2wav.config.codebook_size,
        (code2wav.config.num_quantizers, 24),
        generator=torch.Generator().manual_seed(7),
    )
    with torch.no_grad():
        pcm = code2wav(codes)
    clipped = float((pcm.abs() > 0.99).float().mean())
    rms = float(pcm.pow(2).mean().sqrt())
    assert clipped < 0.01, f"{clipped:.0%} of samples at full scale"
    assert 0.02 < rms < 0.5
