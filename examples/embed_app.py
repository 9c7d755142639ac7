"""An asyncio app that embeds mstar_async: requests, metrics, a speech session, cancellation.

It serves the ``demo`` model (seeded random weights, no download): a speech LM whose codes
stream into a codec, then a guided image loop. Everything runs in the app's own event loop.
Run:

    python examples/embed_app.py
"""

from __future__ import annotations

import asyncio
from typing import Any

from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.runtime import Runtime, open_runtime

#: Demo request inputs for speech only (no image), a few codes per sentence.
SPEECH_ONLY = {"image": False, "max_codes": 24}


async def one_request(runtime: Runtime) -> dict[str, Any]:
    """A full request: stream audio, then an image; report its metrics."""
    async with runtime.generate(text="Hello from the host app.", max_codes=32, steps=4) as out:
        audio = 0.0
        async for item in out:
            if isinstance(item, AudioChunk):
                audio += item.seconds  # a real app would play item.pcm at item.sample_rate
            elif isinstance(item, ImageOutput):
                print(f"image {tuple(item.image.shape)}")
    m = out.metrics
    print(
        f"request {m.request_id}: first audio {m.ttfa * 1000:.1f} ms, {m.audio_seconds:.2f} s "
        f"of audio in {m.total * 1000:.1f} ms (RTF {m.rtf:.3f})"
    )
    return {"audio": audio, "metrics": m}


async def many_requests(runtime: Runtime, count: int = 4) -> list[float]:
    """Requests from several tasks at once: their steps batch together in the runtime."""

    async def speak(text: str) -> float:
        async with runtime.generate(text=text, **SPEECH_ONLY) as out:
            return sum([item.seconds async for item in out])

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(speak(f"Caller number {i}.")) for i in range(count)]
    return [task.result() for task in tasks]


async def speech_session(runtime: Runtime) -> list[int]:
    """Voice text as it arrives (say, from an LLM), sentence by sentence, in order."""
    segments: list[int] = []
    async with runtime.speech_session(**SPEECH_ONLY) as session:

        async def write() -> None:
            for piece in ["Good morning. The wea", "ther is fine", " today. And", " tomorrow"]:
                session.push_text(piece)  # complete sentences start synthesis at once
                await asyncio.sleep(0)  # the LLM producing its next piece
            session.flush()  # "And tomorrow" has no full stop: speak it anyway
            session.end_input()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(write())
            async for chunk in session:
                segments.append(chunk.segment)
    print(f"session spoke {session.segments}")
    return segments


async def cancellation(runtime: Runtime) -> tuple[bool, bool]:
    """Two ways to stop a request early; both free what its engines hold before returning."""
    # 1. Stop reading: leaving the ``async with`` cancels the request and waits for its release.
    async with runtime.generate(text="A long story.", max_codes=400, image=False) as out:
        async for _ in out:
            break
    # 2. Cancel the task that reads it, as a host app does on a client disconnect.
    first = asyncio.Event()
    streams = []

    async def listen() -> None:
        async with runtime.generate(text="Another long story.", max_codes=400) as stream:
            streams.append(stream)
            async for _ in stream:
                first.set()

    task = asyncio.create_task(listen())
    await first.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        print("listener cancelled")
    return out.metrics.cancelled, streams[0].metrics.cancelled


async def main() -> dict[str, Any]:
    """Open the runtime once and run each part; returns what each part measured."""
    async with open_runtime(build_model("demo")) as runtime:
        return {
            "request": await one_request(runtime),
            "many": await many_requests(runtime),
            "session": await speech_session(runtime),
            "cancelled": await cancellation(runtime),
        }


if __name__ == "__main__":
    asyncio.run(main())
