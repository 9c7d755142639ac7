"""Embed mstar_async in an asyncio program and run the demo model.

The demo is a small composite model built from seeded random weights: a GRU language model emits
audio codes in a DynamicLoop, the codes stream through a sliding-window chunk policy into a codec
that returns PCM while the loop still runs, and a Loop of guided denoising steps (conditional
and unconditional branches in Parallel) produces an image. Run:

    python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import time

from mstar_async.models import build_model
from mstar_async.outputs import AudioChunk, ImageOutput
from mstar_async.runtime import open_runtime


async def main() -> None:
    model = build_model("demo")
    async with open_runtime(model) as runtime:
        started = time.perf_counter()
        first_audio = None
        audio_seconds = 0.0
        async with runtime.generate(text="Hello from mstar_async.", max_codes=48) as outputs:
            async for item in outputs:
                if isinstance(item, AudioChunk):
                    if first_audio is None:
                        first_audio = time.perf_counter() - started
                    audio_seconds += item.seconds
                    print(f"audio chunk: {item.pcm.numel()} samples at {item.sample_rate} Hz")
                elif isinstance(item, ImageOutput):
                    print(f"image: {tuple(item.image.shape)}, mean {float(item.image.mean()):.3f}")
        total = time.perf_counter() - started
    assert first_audio is not None
    print(
        f"first audio after {first_audio * 1000:.1f} ms; {audio_seconds:.2f} s of audio; "
        f"request took {total * 1000:.1f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
