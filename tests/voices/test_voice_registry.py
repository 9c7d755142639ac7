"""The voice store and registry: limits before any work, persistence, sharing between stores
of one directory, and 100 register/delete cycles leaving no file and no KV block behind (a
spoken voice's kept prompt rows go with its delete)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import soundfile
import torch

from mstar_async.errors import VoiceError, VoiceLimitError, VoiceNotFound
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import open_runtime
from mstar_async.voices import VoiceLimits, VoiceStore, decode_audio
from mstar_async.voices.store import valid_id

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread."""


def _pcm(seconds: float = 1.0, rate: int = 24_000) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return 0.3 * torch.sin(2 * torch.pi * 200 * t)


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, _pcm(seconds, rate).numpy(), rate, format="WAV")
    return buffer.getvalue()


def _add(store: VoiceStore, name: str = "a") -> str:
    speaker = torch.randn(64)
    codes = torch.randint(0, 64, (5, 4))
    return store.add(name=name, model="m", speaker=speaker, codes=codes, transcript="hi").id


def test_store_persists_and_is_shared_by_every_store_of_the_directory(tmp_path: Path) -> None:
    first = VoiceStore(tmp_path)
    voice = _add(first, "../../etc/passwd")  # a name is a label, never a path
    assert valid_id(voice)
    assert first.files() == [".lock", "index.json", f"{voice}.safetensors"]
    other = VoiceStore(tmp_path)  # another replica, or the server after a restart
    assert [r.id for r in other.records()] == [voice]
    assert other.record(voice).name == "../../etc/passwd" and other.record(voice).frames == 5
    loaded = other.load(voice)
    assert loaded.codes is not None and loaded.codes.shape == (5, 4)
    second = _add(other, "b")
    assert [r.id for r in first.records()] == [voice, second]  # seen through the index
    first.delete(second)
    with pytest.raises(VoiceNotFound):
        other.load(second)
    for bad in ("voice_../../x", "index", "voice_" + "g" * 24):
        with pytest.raises(VoiceNotFound):
            other.record(bad)


def test_store_limits_and_crash_leftovers(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, VoiceLimits(max_voices=2))
    _add(store)
    _add(store)
    with pytest.raises(VoiceLimitError, match="limit of 2 voices"):
        store.check_room()
    with pytest.raises(VoiceLimitError):
        _add(store)
    assert len(store) == 2 and len(store.files()) == 4
    # A crash between the file write and the index write leaves an orphan: swept on open.
    (tmp_path / "voice_0123456789abcdef01234567.safetensors").write_bytes(b"x")
    (tmp_path / "index.tmp").write_text("{")
    assert len(VoiceStore(tmp_path).files()) == 4
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 1


def test_decode_audio_checks_length_from_the_header() -> None:
    pcm, rate = decode_audio(_wav(1.0), max_seconds=2.0)
    assert rate == 16_000 and pcm.shape == (16_000,)
    with pytest.raises(VoiceLimitError, match="lasts 3.0 s; at most 2 s"):
        decode_audio(_wav(3.0), max_seconds=2.0)
    with pytest.raises(VoiceError, match="not an audio file"):
        decode_audio(b"not audio at all", max_seconds=2.0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_registered_voice_speaks_and_100_cycles_leave_nothing(tmp_path: Path) -> None:
    model = build_model("qwen3-tts", size="tiny", chunk=4)
    limits = VoiceLimits(max_voices=3, max_audio_seconds=2.0)
    async with open_runtime(model, voices=VoiceStore(tmp_path, limits)) as runtime:
        engines: list[Any] = [runtime.batching.engines[name] for name in ("talker", "predictor")]
        with anyio.fail_after(60):
            record = await runtime.register_voice(
                _wav(1.0), name="mine", transcript="A short test."
            )
            assert record.frames == 13 and record.transcript == "A short test."
            voice = await runtime.voice(record.id)
            async with runtime.generate(text="Hello there.", voice=voice, max_tokens=6) as out:
                items = [i async for i in out]
            assert sum(i.pcm.numel() for i in items if isinstance(i, AudioChunk)) == 6 * 1920
            await _kept(runtime, engines[0], {f"voice:{record.id}"})
            # The decoder's state after the voice's reference codes, for its first windows.
            decoder_voices = runtime.batching.engines["decoder"].ops["forget"].__self__
            assert len(decoder_voices) == 1
            with pytest.raises(VoiceLimitError, match="lasts 3.0 s"):
                await runtime.register_voice(_pcm(3.0), name="long")
            with pytest.raises(VoiceError, match="give the voice a name"):
                await runtime.register_voice(_pcm(1.0), name=" ")
            await runtime.delete_voice(record.id)
            assert engines[0].handles == {}  # the voice's kept KV went with it
            assert len(decoder_voices) == 0  # and the decoder's state
            for i in range(100):
                made = await runtime.register_voice(_pcm(0.2), name=f"v{i}")
                assert made.frames == 0  # no transcript: the speaker embedding alone
                if i % 10 == 0:  # spoken: its KV is kept until the delete
                    voice = await runtime.voice(made.id)
                    async with runtime.generate(text="Hi.", voice=voice, max_tokens=2) as out:
                        assert len([item async for item in out]) > 0
                    await _kept(runtime, engines[0], {f"voice:{made.id}"})
                await runtime.delete_voice(made.id)
        assert runtime.list_voices() == []
        assert runtime.voices is not None and runtime.voices.store.files() == [
            ".lock",
            "index.json",
        ]
        assert [e.blocks_in_use for e in engines] == [0, 0] and engines[0].handles == {}


async def _kept(runtime: Any, talker: Any, handles: set[str]) -> None:
    """Wait until the last request is released: the talker then keeps exactly ``handles``."""
    with anyio.fail_after(10):
        while runtime.batching.kv_blocks_in_use > talker.kept_blocks:  # noqa: ASYNC110  (counts)
            await anyio.sleep(0.005)
    assert set(talker.handles) == handles


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_bench_rows_time_each_kind_of_voice() -> None:
    from mstar_async.bench.speech import _figures, stream_one
    from mstar_async.bench.speech_voices import REFERENCE_TRANSCRIPT, VOICE_SYSTEMS, measure_voices
    from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
    from mstar_async.models.qwen3_tts.program import chat_ids

    model = build_model("qwen3-tts", size="tiny", chunk=4)
    async with open_runtime(model) as runtime:
        with anyio.fail_after(60):
            rows = await measure_voices(
                runtime,
                [{"text": "Hello there.", "seed": 1, "max_tokens": 5}],
                stream_one=stream_one,
                figures=_figures,
            )
    assert list(rows["systems"]) == list(VOICE_SYSTEMS)
    assert rows["reference_frames"] == 75  # 6 s at 12.5 frames a second
    # Kept: the role, 3 codec tags, the speaker, pad and the transcript's rows.
    tokenizer = ChatTokenizer.from_folder(smollm2_folder())
    role, transcript = chat_ids(tokenizer, REFERENCE_TRANSCRIPT, "<|im_end|>\n")
    assert rows["kept_prompt_rows"] == len(role) + 5 + len(transcript)
    assert rows["reused_prompt_rows"] == rows["kept_prompt_rows"]  # the one registered request
    assert set(rows["ratios"]) == {
        "registered/named",
        "registered_no_reuse/registered",
        "inline/registered",
    }
    assert all(f["requests"] == 1 and f["ttfa_p50_s"] > 0 for f in rows["systems"].values())
    assert [a["target"] for a in rows["aims"]] == [1.2, 2.0]
