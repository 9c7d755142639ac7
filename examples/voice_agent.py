"""A Pipecat voice-agent pipeline whose speech comes from mstar_async's orpheus, in-process.

No microphone, speaker or network here, so the pipeline's ends are stand-ins: a scripted LLM
reply goes in (the frames an LLM service emits), and the bot's audio is written to a WAV file
instead of a transport. In a real agent the pipeline reads

    Pipeline([
        transport.input(),            # e.g. SmallWebRTCTransport / DailyTransport audio in
        stt,                          # speech to text
        user_aggregator,              # LLMContextAggregatorPair(...).user()
        llm,                          # the LLM service
        tts,                          # MstarTTSService, as below
        transport.output(),           # plays the TTSAudioRawFrames; barge-in interrupts it
        assistant_aggregator,
    ])

Run (needs ``pip install 'mstar-async[voice]'``):

    python examples/voice_agent.py --out reply.wav
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import wave
from collections.abc import Sequence
from pathlib import Path

from pipecat.frames.frames import (
    EndFrame,
    Frame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from mstar_async.integrations.pipecat import MstarTTSService
from mstar_async.models import build_model
from mstar_async.runtime import open_runtime

REPLY = "Hello! I am a voice agent. My speech comes from a runtime in this very process."


class WavWriter(FrameProcessor):
    """Stands where the output transport goes: collects the bot's audio into a WAV file."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.samples = 0
        self.first_audio: float | None = None
        self._wav: wave.Wave_write | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.first_audio = self.first_audio or time.perf_counter()
            if self._wav is None:
                self._wav = wave.open(str(self.path), "wb")
                self._wav.setnchannels(frame.num_channels)
                self._wav.setsampwidth(2)
                self._wav.setframerate(frame.sample_rate)
            self._wav.writeframes(frame.audio)
            self.samples += len(frame.audio) // (2 * frame.num_channels)
        elif isinstance(frame, EndFrame) and self._wav is not None:
            self._wav.close()
            self._wav = None
        await self.push_frame(frame, direction)


def llm_reply(text: str) -> list[Frame]:
    """The frames an LLM service pushes for one reply, a word at a time."""
    words = [LLMTextFrame(word) for word in re.findall(r"\S+\s*", text)]
    return [LLMFullResponseStartFrame(), *words, LLMFullResponseEndFrame()]


async def main(argv: Sequence[str] | None = None) -> int:
    """Speak ``--text`` through the pipeline into ``--out``; return the samples written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=REPLY)
    parser.add_argument("--out", type=Path, default=Path("voice_agent.wav"))
    parser.add_argument("--size", default="tiny", help="orpheus size: tiny or small")
    parser.add_argument("--voice", default="tara")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-rate", type=int, default=24_000, help="pipeline output rate")
    args = parser.parse_args(argv)

    # The application owns the runtime: it may serve other requests (or other pipelines)
    # while this one runs. MstarTTSService(model=...) would open and close its own instead.
    async with open_runtime(build_model("orpheus", size=args.size)) as runtime:
        tts = MstarTTSService(runtime=runtime, voice=args.voice, inputs={"seed": args.seed})
        sink = WavWriter(args.out)
        worker = PipelineWorker(
            Pipeline([tts, sink]),
            params=PipelineParams(audio_out_sample_rate=args.sample_rate),
            enable_rtvi=False,
            idle_timeout_secs=None,
        )
        runner = WorkerRunner(handle_sigint=False)
        started = time.perf_counter()
        await worker.queue_frames([*llm_reply(args.text), EndFrame()])
        await runner.add_workers(worker)
        await runner.run()
    seconds = sink.samples / args.sample_rate
    ttfa = (sink.first_audio or started) - started
    print(f"wrote {args.out}: {seconds:.2f} s of speech, first audio after {ttfa:.2f} s")
    return sink.samples


if __name__ == "__main__":
    asyncio.run(main())
