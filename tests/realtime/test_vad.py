"""Silero VAD in torch: the package's own model's numbers, batching across streams, speech
found where a sentence is spoken, and no state left after a stream ends."""

from __future__ import annotations

import math
import warnings
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
import torch

from mstar_async.engines import Step
from mstar_async.models import build_model
from mstar_async.policies import Chunk, LeftContextChunkPolicy
from mstar_async.realtime.vad import CONTEXT, FRAME, VADEngine, load_vad, weights_path
from tests.realtime.audio import sentence, with_silence

RATE = 16_000


@pytest.fixture(scope="module")
def engine() -> VADEngine:
    return VADEngine(load_vad())


def _signal(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * RATE)) / RATE
    voiced = (torch.sin(2 * math.pi * 3 * t) > 0).float()
    return 0.3 * torch.sin(2 * math.pi * 220 * t) * voiced + 0.01 * torch.randn(len(t), generator=g)


def _frames(samples: torch.Tensor) -> list[Chunk]:
    policy = LeftContextChunkPolicy(FRAME, CONTEXT)
    return [*policy.push(samples), *policy.close()]


def _run(engine: VADEngine, request: str, chunks: list[Chunk]) -> list[float]:
    out = []
    for chunk in chunks:
        (result,) = engine.forward([Step(request, "detect", {"audio": chunk})])
        assert isinstance(result, dict)
        out.append(result["speech"])
    engine.release(request)
    return out


def test_probabilities_equal_the_packaged_torchscript_model(engine: VADEngine) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.load(str(weights_path()))
    signal = torch.cat([_signal(1.5, 0), torch.from_numpy(sentence("weather", RATE))])
    expected = []
    with torch.inference_mode():
        for start in range(0, len(signal), FRAME):
            frame = signal[start : start + FRAME]
            frame = torch.nn.functional.pad(frame, (0, FRAME - len(frame)))
            expected.append(float(scripted(frame.unsqueeze(0), RATE)))
    ours = _run(engine, "r", _frames(signal))
    assert len(ours) == len(expected) == math.ceil(len(signal) / FRAME)
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) < 1e-5
    assert max(expected) > 0.9  # the sentence is heard as speech


def test_streams_batched_in_one_forward_equal_each_stream_alone(engine: VADEngine) -> None:
    signals = [_signal(1.0, seed) for seed in range(3)]
    alone = [_run(engine, f"alone{i}", _frames(s)) for i, s in enumerate(signals)]
    frames = [_frames(s) for s in signals]
    batched: list[list[float]] = [[], [], []]
    for k in range(len(frames[0])):
        steps = [Step(f"b{i}", "detect", {"audio": frames[i][k]}) for i in range(3)]
        for i, result in enumerate(engine.forward(steps)):
            assert isinstance(result, dict)
            batched[i].append(result["speech"])
    for i in range(3):
        np.testing.assert_allclose(batched[i], alone[i], atol=1e-5)
        engine.release(f"b{i}")
    assert engine.streams == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_spoken_sentence_between_silences_is_speech_and_only_it() -> None:
    audio = with_silence(sentence("weather", RATE), 1.0, 1.0, RATE)

    async def pieces() -> AsyncIterator[torch.Tensor]:
        for start in range(0, len(audio), 320):  # 20 ms pieces, as a microphone sends them
            yield torch.from_numpy(audio[start : start + 320])

    from mstar_async.runtime import open_runtime

    async with open_runtime(build_model("silero-vad")) as runtime:
        with anyio.fail_after(30):
            async with runtime.generate(audio=pieces()) as outputs:
                probabilities = [p async for p in outputs]
        assert runtime.batching.engines["vad"].streams == 0
    assert len(probabilities) == math.ceil(len(audio) / FRAME)
    speech = [i for i, p in enumerate(probabilities) if p > 0.5]
    frame_s = FRAME / RATE
    first, last = speech[0] * frame_s, (speech[-1] + 1) * frame_s
    spoken_end = len(audio) / RATE - 1.0
    assert 0.9 <= first <= 1.3, first
    assert spoken_end - 0.4 <= last <= spoken_end + 0.3, (last, spoken_end)
