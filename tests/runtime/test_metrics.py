"""Per-request metrics: filled as outputs flow, consistent with what the client received, logged
with the request id when the request ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from mstar_async.conductor import RequestMetrics
from mstar_async.errors import RequestError
from mstar_async.graph import Node, Walk
from mstar_async.logs import configure_logging
from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, ImageOutput, TextDelta
from mstar_async.runtime import open_runtime
from tests.conductor.helpers import make_model, t
from tests.runtime.helpers import SPEECH, tiny_lm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@dataclass(frozen=True)
class Usage:
    """Stands for a closing output that reports token counts (as ``TextEnd`` does)."""

    prompt_tokens: int
    completion_tokens: int


def test_metrics_account_outputs_in_order_and_close_once() -> None:
    metrics = RequestMetrics("r")
    assert metrics.rtf is None and not metrics.done
    metrics.observe(TextDelta("a"))
    metrics.observe(AudioChunk(torch.zeros(8000), 16_000))
    metrics.observe(AudioChunk(torch.zeros(4000), 16_000))
    metrics.observe(Usage(7, 3))
    metrics.close(cancelled=False, failed=False)
    total = metrics.total
    metrics.close(cancelled=True, failed=True)  # the first close is the outcome
    assert metrics.total == total and metrics.finished and not metrics.cancelled
    assert metrics.outputs == 4
    assert metrics.ttfb == metrics.ttft
    assert metrics.ttfb is not None and metrics.ttfa is not None and total is not None
    assert metrics.ttfb <= metrics.ttfa <= total
    assert metrics.audio_seconds == 0.75
    assert metrics.rtf == pytest.approx(total / 0.75)
    assert (metrics.prompt_tokens, metrics.completion_tokens) == (7, 3)
    with pytest.raises(ValueError, match="completion_tokens must be >= 0"):
        metrics.record_usage(completion_tokens=-1)


async def test_speech_request_metrics_match_the_audio_received() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with anyio.fail_after(30):
            async with runtime.generate(text="Hello there.", max_codes=20, steps=1) as outputs:
                received = [item async for item in outputs]
    m = outputs.metrics
    audio = [item for item in received if isinstance(item, AudioChunk)]
    assert audio and isinstance(received[-1], ImageOutput)
    assert m.finished and not m.cancelled and not m.failed
    assert m.outputs == len(received)
    assert m.audio_seconds == pytest.approx(sum(chunk.seconds for chunk in audio))
    assert m.ttfb is not None and m.ttfa is not None and m.total is not None
    assert m.ttfb == m.ttfa <= m.total  # the first output is audio
    assert m.ttft is None and m.prompt_tokens is None
    assert m.rtf == pytest.approx(m.total / m.audio_seconds)


async def test_text_request_metrics_and_usage_recorded_by_the_program() -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any, n: int = 3) -> AsyncGenerator[Any, None]:
        for i in range(n):
            yield TextDelta(str(float((await request.run("w", x=t(i)))["y"])))
        request.record_usage(prompt_tokens=5, completion_tokens=n)

    model = make_model([node], [Walk("w", "a")], program, {"inc": lambda x: {"y": x + 1}})
    async with open_runtime(model) as runtime:
        async with runtime.generate(n=4) as outputs:
            assert [d.text async for d in outputs] == ["1.0", "2.0", "3.0", "4.0"]
    m = outputs.metrics
    assert (m.prompt_tokens, m.completion_tokens) == (5, 4)
    assert m.ttft is not None and m.total is not None and m.ttft <= m.total
    assert m.ttfa is None and m.rtf is None and m.audio_seconds == 0


async def test_failed_and_cancelled_requests_are_flagged(tiny_folder: Path) -> None:
    node = Node("a", engine="e", op="inc", inputs=["x"], outputs=["y"])

    async def program(request: Any) -> AsyncGenerator[Any, None]:
        yield TextDelta("before")
        raise ValueError("broken program")

    model = make_model([node], [Walk("w", "a")], program, {"inc": lambda x: {"y": x + 1}})
    async with open_runtime(model) as runtime:
        async with runtime.generate() as outputs:
            with pytest.raises(RequestError, match="broken program"):
                async for _ in outputs:
                    pass
    assert outputs.metrics.failed and not outputs.metrics.finished
    assert not outputs.metrics.cancelled and outputs.metrics.outputs == 1
    async with open_runtime(tiny_lm(tiny_folder)) as runtime:
        with anyio.fail_after(30):
            async with runtime.generate(prompt="we", max_tokens=500, ignore_eos=True) as stream:
                await stream.__anext__()
    m = stream.metrics
    assert m.cancelled and not m.finished and not m.failed
    assert m.ttft is not None and m.total is not None and m.ttft <= m.total


async def test_request_end_is_logged_with_the_metrics_and_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configure_logging("INFO")
    logging.getLogger("mstar_async").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="mstar_async"):
            async with open_runtime(build_model("demo")) as runtime:
                with anyio.fail_after(30):
                    async with runtime.generate(request_id="say-1", text="Hi.", **SPEECH) as s:
                        async for _ in s:
                            pass
    finally:
        configure_logging("WARNING")
    ends = [r.getMessage() for r in caplog.records if "event='request.end'" in r.getMessage()]
    assert len(ends) == 1
    m = s.metrics
    for field in (
        "request_id='say-1'",
        "finished=True",
        "cancelled=False",
        f"outputs={m.outputs}",
        f"audio_seconds={round(m.audio_seconds, 4)}",
        f"total={round(m.total or 0, 4)}",
    ):
        assert field in ends[0], (field, ends[0])
