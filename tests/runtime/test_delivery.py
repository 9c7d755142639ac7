"""A request that ends before its client reads still delivers every output it made."""

from __future__ import annotations

import anyio
import pytest

from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import open_runtime
from tests.runtime.helpers import SPEECH

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_outputs_buffered_by_a_finished_request_reach_a_late_reader() -> None:
    async with open_runtime(build_model("demo")) as runtime:
        with anyio.fail_after(20):
            async with runtime.generate(text="How are you?", **SPEECH) as live:
                expected = [item.pcm async for item in live]
            async with runtime.generate(text="How are you?", **SPEECH) as late:
                await late._finished.wait()  # the request is over before anything is read
                assert late.metrics.finished
                assert (await runtime.stats()).conductor.requests == 0
                got = [item async for item in late]
    assert expected and len(got) == len(expected) == late.metrics.outputs
    assert all(
        isinstance(g, AudioChunk) and g.pcm.equal(e) for g, e in zip(got, expected, strict=True)
    )
