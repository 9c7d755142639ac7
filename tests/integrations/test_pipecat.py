"""MstarTTSService in real Pipecat pipelines over tiny orpheus: audio equal to the runtime's
own, resampling, an owned runtime, barge-in that frees the KV blocks at once, the example."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
import time
import wave
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("pipecat", reason="needs the voice extra: pip install 'mstar-async[voice]'")

import soxr
from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import TTSSettings
from pipecat.workers.runner import WorkerRunner

from mstar_async.audio import to_s16le
from mstar_async.integrations.pcm import PcmConverter
from mstar_async.integrations.pipecat import MstarTTSService
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import Runtime, open_runtime

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
SHORT_SEED = 1  # tiny orpheus ends "Hello there, how are you today?" after 7 frames
LONG_SEED = 3  # ... and after 97 frames (8 s of speech): still speaking when interrupted
TEXT = "Hello there, how are you today?"
CANCEL_TO_FREE_S = 0.1


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Two torch threads on a shared 2-core machine run the tiny model 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
async def runtime() -> AsyncIterator[Runtime]:
    async with open_runtime(build_model("orpheus", size="tiny")) as rt:
        yield rt


class Recorder(FrameProcessor):
    """The pipeline's last processor: every frame it sees, with its arrival time."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []
        self.first_audio = asyncio.Event()
        self.interrupted = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append((time.perf_counter(), frame))
            if isinstance(frame, TTSAudioRawFrame):
                self.first_audio.set()
            if isinstance(frame, InterruptionFrame):
                self.interrupted.set()
        await self.push_frame(frame, direction)

    def audio(self) -> list[TTSAudioRawFrame]:
        return [f for _, f in self.frames if isinstance(f, TTSAudioRawFrame)]


def _pipeline(tts: MstarTTSService, sample_rate: int = 24_000) -> tuple[PipelineWorker, Recorder]:
    recorder = Recorder()
    worker = PipelineWorker(
        Pipeline([tts, recorder]),
        params=PipelineParams(audio_out_sample_rate=sample_rate, enable_metrics=True),
        enable_rtvi=False,
        idle_timeout_secs=None,
    )
    return worker, recorder


async def _run(worker: PipelineWorker, frames: Sequence[Frame]) -> None:
    runner = WorkerRunner(handle_sigint=False)
    await worker.queue_frames(list(frames))
    await runner.add_workers(worker)
    await asyncio.wait_for(runner.run(), timeout=60)


def _reply(*sentences: str) -> list[Frame]:
    """What an LLM service emits for one reply, token by token."""
    tokens = [LLMTextFrame(word) for word in re.findall(r"\S+\s*", " ".join(sentences))]
    return [LLMFullResponseStartFrame(), *tokens, LLMFullResponseEndFrame()]


async def _reference(rt: Runtime, text: str, seed: int) -> tuple[torch.Tensor, int]:
    async with rt.generate(text=text, voice="tara", seed=seed) as outputs:
        chunks = [c async for c in outputs if isinstance(c, AudioChunk)]
    return torch.cat([c.pcm for c in chunks]), chunks[0].sample_rate


def _samples(frames: Sequence[TTSAudioRawFrame]) -> np.ndarray:
    return np.frombuffer(b"".join(f.audio for f in frames), dtype="<i2").astype(np.int32)


@pytest.mark.timeout(60)
async def test_a_reply_is_spoken_sentence_by_sentence_as_the_runtime_speaks_it(
    runtime: Runtime,
) -> None:
    tts = MstarTTSService(runtime=runtime, voice="tara", inputs={"seed": SHORT_SEED})
    spoken: list[str] = []

    @tts.event_handler("on_tts_request")  # type: ignore[untyped-decorator]
    async def on_tts_request(service: Any, context_id: str, text: str) -> None:
        spoken.append(text)

    worker, recorder = _pipeline(tts)
    await _run(worker, [*_reply("Hello there.", "How are you today?"), EndFrame()])

    assert [t.strip() for t in spoken] == ["Hello there.", "How are you today?"]
    kinds = [
        type(f) for _, f in recorder.frames if isinstance(f, TTSStartedFrame | TTSStoppedFrame)
    ]
    assert kinds == [TTSStartedFrame, TTSStoppedFrame]  # one audio context for the reply
    audio = recorder.audio()
    assert {(f.sample_rate, f.num_channels) for f in audio} == {(24_000, 1)}
    expected = b"".join([to_s16le((await _reference(runtime, t, SHORT_SEED))[0]) for t in spoken])
    got = _samples(audio)
    want = np.frombuffer(expected, dtype="<i2").astype(np.int32)
    assert got.shape == want.shape and want.size > 0
    assert np.abs(got - want).max() <= 1
    assert runtime.batching.engines["lm"].blocks_in_use == 0 and tts.active_requests == 0
    ttfb = [
        m.value
        for _, f in recorder.frames
        if isinstance(f, MetricsFrame)
        for m in f.data
        if isinstance(m, TTFBMetricsData) and m.processor == tts.name and m.value > 0
    ]
    assert len(ttfb) == 1 and ttfb[0] < 30  # one audio context: the reply's first audio


@pytest.mark.timeout(60)
async def test_a_16khz_pipeline_gets_the_speech_resampled_as_a_stream(runtime: Runtime) -> None:
    tts = MstarTTSService(runtime=runtime, voice="tara", inputs={"seed": SHORT_SEED})
    worker, recorder = _pipeline(tts, sample_rate=16_000)
    await _run(worker, [TTSSpeakFrame(TEXT), EndFrame()])

    audio = recorder.audio()
    assert {f.sample_rate for f in audio} == {16_000}
    pcm, rate = await _reference(runtime, TEXT, SHORT_SEED)
    want = soxr.resample(pcm.numpy(), rate, 16_000, quality="HQ")
    got = _samples(audio) / 32767.0
    assert abs(got.size - want.size) <= 1
    n = min(got.size, want.size)
    assert np.abs(got[:n] - want[:n]).max() < 2e-3  # streaming == one-shot, to quantisation


def test_the_converter_quantises_exactly_at_the_model_rate_and_checks_rates() -> None:
    pcm = torch.linspace(-1.2, 1.2, 1000)
    converter = PcmConverter(24_000)
    assert converter.convert(AudioChunk(pcm, 24_000)) == to_s16le(pcm)
    assert converter.finish() == b""
    with pytest.raises(ValueError, match="changed sample rate from 24000 to 16000"):
        converter.convert(AudioChunk(pcm, 16_000))
    with pytest.raises(ValueError, match="sample_rate must be positive"):
        PcmConverter(0)


@pytest.mark.timeout(60)
async def test_a_service_given_a_model_opens_and_closes_its_own_runtime() -> None:
    tts = MstarTTSService(model=build_model("orpheus", size="tiny"), inputs={"seed": SHORT_SEED})
    with pytest.raises(RuntimeError, match="opens when the pipeline starts"):
        _ = tts.runtime
    worker, recorder = _pipeline(tts)
    await _run(worker, [TTSSpeakFrame(TEXT), EndFrame()])
    assert len(_samples(recorder.audio())) == 7 * 2048
    with pytest.raises(RuntimeError, match="opens when the pipeline starts"):
        _ = tts.runtime  # closed again with the pipeline


@pytest.mark.timeout(60)
async def test_voice_changes_between_utterances_and_a_failed_one_is_skipped(
    runtime: Runtime,
) -> None:
    voices: list[str] = []
    generate = runtime.generate

    def spy(**inputs: Any) -> Any:
        voices.append(inputs["voice"])
        return generate(**inputs)

    runtime.generate = spy  # type: ignore[method-assign]
    # Pipecat ends an audio context that got no audio after stop_frame_timeout_s (3 s).
    tts = MstarTTSService(
        runtime=runtime, voice="nobody", inputs={"seed": SHORT_SEED}, stop_frame_timeout_s=0.5
    )
    worker, recorder = _pipeline(tts)
    use_tara = TTSUpdateSettingsFrame(delta=TTSSettings(voice="tara"))
    await _run(worker, [TTSSpeakFrame(TEXT), use_tara, TTSSpeakFrame(TEXT), EndFrame()])
    assert voices == ["nobody", "tara"]
    assert len(_samples(recorder.audio())) == 7 * 2048  # only the second utterance spoke
    assert not runtime.conductor.active and runtime.batching.engines["lm"].blocks_in_use == 0


@pytest.mark.timeout(60)
async def test_cancelling_the_pipeline_mid_speech_closes_the_owned_runtime() -> None:
    tts = MstarTTSService(model=build_model("orpheus", size="tiny"), inputs={"seed": LONG_SEED})
    worker, recorder = _pipeline(tts)
    runner = WorkerRunner(handle_sigint=False)
    await worker.queue_frames([TTSSpeakFrame(TEXT)])
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(recorder.first_audio.wait(), timeout=30)
    runtime = tts.runtime
    assert tts.active_requests == 1
    await worker.cancel()
    await asyncio.wait_for(running, timeout=30)
    assert tts.active_requests == 0 and not runtime.conductor.active
    assert runtime.batching.engines["lm"].blocks_in_use == 0
    with pytest.raises(RuntimeError, match="conductor is not running"):
        runtime.generate(text=TEXT)  # the runtime was closed with the pipeline
    with pytest.raises(RuntimeError, match="opens when the pipeline starts"):
        _ = tts.runtime


def test_without_pipecat_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pipecat.frames.frames", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "mstar_async.integrations.pipecat")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'mstar-async\[voice\]'"):
        importlib.import_module("mstar_async.integrations.pipecat")


def test_the_service_needs_exactly_one_runtime_source() -> None:
    with pytest.raises(ValueError, match="either runtime= .* or model="):
        MstarTTSService()


@pytest.mark.timeout(60)
async def test_barge_in_stops_the_utterance_and_frees_its_kv_blocks_at_once(
    runtime: Runtime,
) -> None:
    engine = runtime.batching.engines["lm"]
    tts = MstarTTSService(runtime=runtime, voice="tara", inputs={"seed": LONG_SEED})
    worker, recorder = _pipeline(tts)
    runner = WorkerRunner(handle_sigint=False)
    await worker.queue_frames(_reply(TEXT))
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(recorder.first_audio.wait(), timeout=30)
    assert engine.blocks_in_use > 0 and tts.active_requests == 1

    interrupted = time.perf_counter()
    await worker.queue_frame(InterruptionFrame())
    while engine.blocks_in_use:  # noqa: ASYNC110 - polling is the measurement
        await asyncio.sleep(0.0005)
    freed = time.perf_counter() - interrupted
    await asyncio.wait_for(recorder.interrupted.wait(), timeout=5)
    await asyncio.sleep(0.5)  # anything of the utterance still on its way would arrive now
    await worker.queue_frame(EndFrame())
    await asyncio.wait_for(running, timeout=30)

    print(f"barge-in: interruption queued -> KV blocks free in {freed * 1000:.1f} ms")
    assert freed < CANCEL_TO_FREE_S, f"KV blocks freed {freed * 1000:.1f} ms after barge-in"
    assert tts.active_requests == 0 and not runtime.conductor.active
    reached = next(t for t, f in recorder.frames if isinstance(f, InterruptionFrame))
    late = [f for t, f in recorder.frames if isinstance(f, TTSAudioRawFrame) and t > reached]
    assert late == []
    heard = len(_samples(recorder.audio()))
    assert 0 < heard < 97 * 2048  # cut short: the whole utterance is 97 frames


@pytest.mark.timeout(90)
def test_the_voice_agent_example_writes_a_wav_and_logs_no_error(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("voice_agent", ROOT / "examples/voice_agent.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules["voice_agent"] = example
    errors: list[str] = []
    sink = logger.add(lambda message: errors.append(str(message)), level="ERROR")
    try:
        spec.loader.exec_module(example)
        out = tmp_path / "reply.wav"
        # The example's own defaults: every sentence of its reply must make audio.
        samples = asyncio.run(example.main(["--out", str(out)]))
    finally:
        logger.remove(sink)
        del sys.modules["voice_agent"]
    assert errors == []
    with wave.open(str(out)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24_000, 1, 2)
        assert wav.getnframes() == samples > 0
