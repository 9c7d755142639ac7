"""qwen3-tts keeps a registered voice's shared prompt rows: the layout says which rows every
request of a voice shares (upstream's in-context prompt adds the reference codes to the text
row by row, so they end where the request's text begins); a second request of the voice
computes only the rows after them and speaks exactly the frames it speaks without reuse (and
the same audio: the decoder's first window continues from its kept state); under
KV pressure the kept rows are evicted and computed again transparently; ``forget_voice`` drops
them, and a voice cloned for one request keeps nothing. With the talker replicated over two
worker processes, each replica keeps its own copy and a delete drops both."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.engines.kv.prefill_rows import common_prefix
from mstar_async.models import build_model
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.models.qwen3_tts.model import prompt_ids, seeded_config
from mstar_async.models.qwen3_tts.program import chat_ids, layout_for, voice_handle
from mstar_async.models.qwen3_tts.prompt import TalkerPrompt, row_keys
from mstar_async.models.qwen3_tts.voice import VoicePrompt
from mstar_async.outputs import AudioChunk, LatentOutput
from mstar_async.placement import Placement
from mstar_async.runtime import open_runtime
from mstar_async.worker.pool import WorkerPool

pytestmark = pytest.mark.timeout(90)

TEXT = "Hello there, how are you today?"
TRANSCRIPT = "A short test of the voice."
VOICE_ID = "voice_" + "0" * 24
GREEDY = {"temperature": 0.0, "subtalker_temperature": 0.0, "seed": 3, "max_tokens": 10}
#: A talker pool of 6 blocks of 16 tokens (tiny: 2 layers, 2 KV heads of 16, float32).
SMALL_KV = 6 * 16 * 2 * 2 * 2 * 16 * 4


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_folder(smollm2_folder())


def _layout(tokenizer: ChatTokenizer, voice: VoicePrompt, text: str, **kw: Any) -> TalkerPrompt:
    cfg = seeded_config("tiny", 0, tokenizer)
    return layout_for(
        tokenizer,
        cfg,
        prompt_ids(cfg, tokenizer),
        text,
        speaker=None,
        language=kw.get("language", "auto"),
        instruct=kw.get("instruct", ""),
        voice=voice,
        streaming_text=kw.get("streaming_text"),
    )


@pytest.mark.parametrize("streaming", [True, False])
def test_voice_rows_end_where_the_text_to_speak_begins(
    tokenizer: ChatTokenizer, streaming: bool
) -> None:
    codes = torch.randint(0, 64, (19, 4), generator=torch.Generator().manual_seed(0))
    voice = VoicePrompt(torch.zeros(64), codes, TRANSCRIPT, VOICE_ID)
    ref = chat_ids(tokenizer, TRANSCRIPT, "<|im_end|>\n")[1]
    role, body = chat_ids(tokenizer, TEXT, "<|im_end|>\n<|im_start|>assistant\n")
    one = _layout(tokenizer, voice, TEXT, streaming_text=streaming)
    other = _layout(tokenizer, voice, "Something else.", streaming_text=streaming)
    # The role, 3 codec tags, the speaker, pad, then the transcript's rows.
    n = one.voice_rows
    assert n == len(role) + 5 + len(ref) < one.layout.shape[0]
    assert one.layout[n, 0] == body[0] and one.layout[n - 1, 0] == ref[-1]
    same = row_keys(one.layout, n, VOICE_ID)
    assert same == row_keys(other.layout, n, VOICE_ID)
    assert same[len(role) + 3] == ("speaker", VOICE_ID)  # the embedding, by the voice's id
    assert row_keys(one.layout, n + 1, VOICE_ID)[n] != row_keys(other.layout, n + 1, VOICE_ID)[n]
    # An instruction leads the prompt, so its rows are part of what is shared (and keyed).
    told = _layout(tokenizer, voice, TEXT, instruct="Slowly.", streaming_text=streaming)
    keys = row_keys(told.layout, told.voice_rows, VOICE_ID)
    assert told.voice_rows > n and common_prefix(keys, same) == 1  # <|im_start|> alone


class Talker:
    """The runtime's talker engine, counting the rows its forwards compute."""

    def __init__(self, runtime: Any) -> None:
        self.engine = runtime.batching.engines["talker"]
        # The decoder's kept convolution state per voice (its forget op's owner).
        self.decoder_voices = runtime.batching.engines["decoder"].ops["forget"].__self__
        self.rows = 0
        self.pcm = torch.zeros(0)
        stack = self.engine.stack

        def counting(x: torch.Tensor, attention: Any) -> torch.Tensor:
            self.rows += int(x.shape[0])
            out: torch.Tensor = stack(x, attention)
            return out

        self.engine.stack = counting

    async def speak(self, runtime: Any, **inputs: Any) -> tuple[list[Any], int]:
        """The frames of one request and the rows the talker computed for it, once released."""
        before = self.rows
        with anyio.fail_after(60):
            inputs = {"text": TEXT, **GREEDY, **inputs}
            async with runtime.generate(return_codes=True, **inputs) as out:
                items = [i async for i in out]
            frames = [i.latent.tolist() for i in items if isinstance(i, LatentOutput)]
            self.pcm = torch.cat([i.pcm for i in items if isinstance(i, AudioChunk)])
            # Released once what is left is what handles keep (the engines' counts: no event).
            while runtime.batching.kv_blocks_in_use > self.engine.kept_blocks:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        return frames, self.rows - before


async def _voice(runtime: Any) -> VoicePrompt:
    t = torch.arange(36_000) / 24_000
    pcm = 0.3 * torch.sin(2 * torch.pi * 180 * t)
    with anyio.fail_after(60):
        async with runtime.generate(
            text="", ref_audio=pcm, ref_text=TRANSCRIPT, encode_only=True
        ) as out:
            (voice,) = [v async for v in out]
    return VoicePrompt(voice.speaker, voice.codes, voice.transcript, VOICE_ID)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_registered_voice_computes_its_shared_rows_once(tokenizer: ChatTokenizer) -> None:
    model = build_model("qwen3-tts", size="tiny", chunk=4)
    async with open_runtime(model) as runtime:
        talker = Talker(runtime)
        voice = await _voice(runtime)
        shared = _layout(tokenizer, voice, TEXT).voice_rows
        once = VoicePrompt(voice.speaker, voice.codes, voice.transcript)  # no id: no reuse
        plain, rows = await talker.speak(runtime, voice=once)
        plain_pcm = talker.pcm
        assert talker.engine.handles == {} and len(talker.decoder_voices) == 0
        first, first_rows = await talker.speak(runtime, voice=voice)  # computes, then keeps
        assert first == plain and first_rows == rows
        handle = voice_handle(VOICE_ID)
        assert talker.engine.handles == {handle: ("prefix", shared, -(-shared // 16))}
        # The decoder's first window continued from the state after the reference frames.
        assert len(talker.decoder_voices) == 1
        torch.testing.assert_close(talker.pcm, plain_pcm, atol=1e-5, rtol=1e-5)
        for _ in range(2):
            again, again_rows = await talker.speak(runtime, voice=voice)
            assert again == plain and again_rows == rows - shared
            torch.testing.assert_close(talker.pcm, plain_pcm, atol=1e-5, rtol=1e-5)
        assert talker.engine.reused_tokens == 2 * shared
        # Another text of the voice shares the same rows.
        _, other_rows = await talker.speak(runtime, voice=voice, text="Something else.")
        _, other_plain = await talker.speak(runtime, voice=once, text="Something else.")
        assert other_rows == other_plain - shared
        # A voice cloned for one request keeps nothing.
        t = torch.arange(36_000) / 24_000
        inline = {"ref_audio": 0.3 * torch.sin(2 * torch.pi * 180 * t), "ref_text": TRANSCRIPT}
        cloned, _ = await talker.speak(runtime, **inline)
        assert cloned == plain and set(talker.engine.handles) == {handle}
        with anyio.fail_after(30):
            async with runtime.generate(text="", forget_voice=VOICE_ID) as out:
                assert [o async for o in out] == []
        assert talker.engine.handles == {} and runtime.batching.kv_blocks_in_use == 0
        assert len(talker.decoder_voices) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_kv_pressure_evicts_the_kept_rows_and_they_are_computed_again() -> None:
    model = build_model("qwen3-tts", size="tiny", chunk=4, kv_cache_bytes=SMALL_KV)
    async with open_runtime(model) as runtime:
        talker = Talker(runtime)
        voice = await _voice(runtime)
        first, rows = await talker.speak(runtime, voice=voice)
        handle = voice_handle(VOICE_ID)
        assert set(talker.engine.handles) == {handle}
        # A named speaker's long speech needs every block of the pool: the voice's go.
        await talker.speak(runtime, speaker="ryan", max_tokens=70)
        assert talker.engine.handles == {}
        again, again_rows = await talker.speak(runtime, voice=voice)  # computed, kept again
        assert again == first and again_rows == rows
        assert set(talker.engine.handles) == {handle}
        _, resumed_rows = await talker.speak(runtime, voice=voice)
        assert resumed_rows < rows


#: The talker's nodes on two worker ranks (replicas), with the code predictor that shares its
#: decode loop (a loop lives on one rank: each replica runs the whole loop); the rest of the
#: model on rank 0.
LOOP_NODES = ("talker_prefill", "talker", "talker_forget", "predictor_prefill", "predictor")
TALKER_REPLICAS = Placement(nodes={node: [0, 1] for node in LOOP_NODES})


async def _stats_when(
    pool: WorkerPool, settled: Callable[[list[dict[str, int]]], bool], seconds: float = 20
) -> list[dict[str, int]]:
    """Both ranks' worker stats once ``settled`` holds of them, or the last ones at the
    deadline (the caller's asserts then say what differs)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = [await pool.worker_stats(rank) for rank in (0, 1)]
        if settled(stats) or time.monotonic() > deadline:
            return stats
        await anyio.sleep(0.01)


def _idle(stats: list[dict[str, int]]) -> bool:
    """Every request released: what the ranks hold is what their handles keep."""
    return all(s["kv_blocks"] == s["kv_kept_blocks"] for s in stats)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_delete_drops_the_voice_kv_on_every_talker_replica(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    model = build_model("qwen3-tts", size="tiny", chunk=4)
    async with open_runtime(model, placement=TALKER_REPLICAS, voices=tmp_path) as runtime:
        assert runtime.pool is not None
        t = torch.arange(12_000) / 24_000
        with anyio.fail_after(60):
            record = await runtime.register_voice(
                0.3 * torch.sin(2 * torch.pi * 180 * t), name="replicated"
            )  # no transcript: the speaker embedding alone, the faster encoder
            voice = await runtime.voice(record.id)

            async def speak() -> None:
                async with runtime.generate(text=TEXT, voice=voice, **GREEDY) as out:
                    assert [i async for i in out]

            # Two at once: the router gives each its own talker replica, and both keep the
            # voice's rows when released.
            async with anyio.create_task_group() as tg:
                tg.start_soon(speak)
                tg.start_soon(speak)
        shared = _layout(tokenizer, VoicePrompt(voice.speaker, None, None, record.id), TEXT)
        blocks = -(-shared.voice_rows // 16)
        before = await _stats_when(
            runtime.pool, lambda s: _idle(s) and all(r["kv_handles"] == 1 for r in s)
        )
        assert [(r["kv_handles"], r["kv_kept_blocks"]) for r in before] == [(1, blocks)] * 2
        with anyio.fail_after(30):
            await runtime.delete_voice(record.id)
        after = await _stats_when(
            runtime.pool, lambda s: all(r["kv_handles"] == r["kv_blocks"] == 0 for r in s)
        )
        assert [(r["kv_handles"], r["kv_kept_blocks"], r["kv_blocks"]) for r in after] == [
            (0, 0, 0)
        ] * 2
