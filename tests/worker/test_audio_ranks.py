"""qwen3-omni's speech in across worker processes: the audio encoder on its own rank (the
streamed speech fed to it over the wire, its rows back to the program), the thinker's prefill
taking them as tensor inputs on another, and a conversation kept and resumed there; the same
text as in one process, nothing left behind."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from mstar_async.models import build_model
from mstar_async.outputs import EncodedAudio, TextDelta
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime

from .test_segments import assert_nothing_left

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    # Worker processes take most of its time; one event loop is enough for what it checks.
    pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"]),
]


def _speech(seconds: float) -> torch.Tensor:
    t = torch.arange(int(seconds * 16_000)) / 16_000
    return 0.3 * torch.sin(2 * math.pi * 200 * t * (1 + t)) * torch.exp(-t)


async def _pieces(pcm: torch.Tensor) -> AsyncIterator[torch.Tensor]:
    for start in range(0, pcm.numel(), 320):
        yield pcm[start : start + 320]


async def _turns(runtime: Runtime) -> list[Any]:
    """Encode streamed speech, answer it, then answer a typed follow-up in the same session."""
    pcm = _speech(1.4)
    out: list[Any] = []
    with anyio.fail_after(90):
        async with runtime.generate(audio=_pieces(pcm), encode_only=True) as outputs:
            heard = [o async for o in outputs]
        assert all(isinstance(o, EncodedAudio) for o in heard)
        rows = torch.cat([o.rows for o in heard])
        out.append((rows.shape, [o.frames for o in heard]))
        conversation: list[dict[str, Any]] = [{"role": "user", "content": "", "audio": rows}]
        for follow_up in ("", "Why?"):
            if follow_up:
                conversation += [
                    {"role": "assistant", "content": out[-1]},
                    {"role": "user", "content": follow_up},
                ]
            async with runtime.generate(
                messages=conversation, session="c", max_tokens=5, speak=False, ignore_eos=True
            ) as outputs:
                out.append("".join([o.text async for o in outputs if isinstance(o, TextDelta)]))
        async with runtime.generate(session="c", end_session=True) as outputs:
            [o async for o in outputs]
    return [out, rows]


async def test_speech_in_split_across_ranks_gives_the_in_process_answers() -> None:
    async with open_runtime(build_model("qwen3-omni")) as local:
        (want, want_rows) = await _turns(local)
    placement = Placement(nodes={"audio_in": 1})
    async with open_runtime(build_model("qwen3-omni"), placement=placement) as runtime:
        (got, got_rows) = await _turns(runtime)
        await assert_nothing_left(runtime)
    assert got == want and got[1] and got[2]
    # Ranks get their own share of the cores: reductions may differ in the last bits.
    torch.testing.assert_close(got_rows, want_rows, atol=1e-5, rtol=0)
