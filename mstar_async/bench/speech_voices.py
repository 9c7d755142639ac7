"""The cloned-voice rows of ``mstar bench speech --model qwen3-tts``.

Four kinds of request speak the same texts on the same runtime, interleaved round by round so
a shared machine's drift meets each alike: ``named`` (a built-in speaker), ``registered`` (a
voice cloned in context, computed once by the voice registry: the request reads its stored
embedding and reference codes, and the talker resumes the KV of the prompt rows every request
of the voice shares, kept by one untimed request before the rounds), ``registered_no_reuse``
(the same stored voice without its id, so the talker computes every prompt row) and
``inline`` (the same recording sent with every request: both encoders run per request, as
without a registry). The aims compare their time to first audio: a registered voice within
1.2x of a named one, and at least 2x faster than inline.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

from mstar_async.bench.report import aim_entry
from mstar_async.models.qwen3_tts.program import voice_handle
from mstar_async.voices import VoiceRegistry, VoiceStore

__all__ = ["REFERENCE_TRANSCRIPT", "VOICE_SYSTEMS", "measure_voices", "reference_recording"]

VOICE_SYSTEMS = ("named", "registered", "registered_no_reuse", "inline")
#: Seconds of reference audio: a typical cloning prompt (upstream suggests a few seconds).
REFERENCE_SECONDS = 6.0
REFERENCE_TRANSCRIPT = "This is the reference recording of the voice to clone, read aloud."


def reference_recording(seconds: float = REFERENCE_SECONDS, seed: int = 0) -> torch.Tensor:
    """A deterministic 24 kHz 'recording': a voiced tone with a drifting pitch and noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 24_000)) / 24_000
    pitch = 140 + 30 * torch.sin(2 * torch.pi * 0.7 * t)
    phase = 2 * torch.pi * torch.cumsum(pitch, 0) / 24_000
    voiced = 0.2 * torch.sin(phase) + 0.1 * torch.sin(2 * phase)
    return voiced + 0.01 * torch.randn(t.shape, generator=gen)


async def measure_voices(
    runtime: Any,
    requests: Sequence[dict[str, Any]],
    *,
    stream_one: Callable[[Any, dict[str, Any]], Awaitable[Any]],
    figures: Callable[[Sequence[Any], float, float | None], dict[str, Any]],
) -> dict[str, Any]:
    """Time ``requests`` (one after another) as each kind of voice; figures per kind, the
    ratios, the two aims, the prompt rows the registered voice keeps and those its timed
    requests took from the kept handle (``runtime`` runs in this process). The recording is
    registered once, in a temporary store.

    Raises:
        RuntimeError: a request made no audio.
    """
    pcm = reference_recording()
    with tempfile.TemporaryDirectory(prefix="mstar-bench-voices-") as folder:
        registry = VoiceRegistry(VoiceStore(folder), runtime.model.name)
        record = await registry.register(
            runtime, pcm, 24_000, name="bench", transcript=REFERENCE_TRANSCRIPT
        )
        voice = await registry.voice(record.id)
        kinds: dict[str, dict[str, Any]] = {
            "named": {"speaker": "ryan"},
            "registered": {"voice": voice},
            "registered_no_reuse": {"voice": dataclasses.replace(voice, id=None)},
            "inline": {"ref_audio": pcm, "ref_text": REFERENCE_TRANSCRIPT},
        }
        # Warm the voice: its shared prompt rows are computed and kept by this request, once
        # it is released (a moment after its stream ends).
        await stream_one(runtime, {**requests[0], **kinds["registered"], "max_tokens": 1})
        talker, handle = runtime.batching.engines["talker"], voice_handle(record.id)
        with anyio.fail_after(10):
            while handle not in talker.handles:  # noqa: ASYNC110  (the engine's state)
                await anyio.sleep(0.005)
        kept_rows, reused = talker.handles[handle][1], talker.reused_tokens
        timings: dict[str, list[Any]] = {kind: [] for kind in VOICE_SYSTEMS}
        walls: dict[str, float] = dict.fromkeys(VOICE_SYSTEMS, 0.0)
        for i, base in enumerate(requests):
            shift = i % len(VOICE_SYSTEMS)
            for kind in (*VOICE_SYSTEMS[shift:], *VOICE_SYSTEMS[:shift]):
                timing = await stream_one(runtime, {**base, **kinds[kind]})
                timings[kind].append(timing)
                walls[kind] += timing.e2e_s
        reused = talker.reused_tokens - reused
        await registry.delete(record.id, runtime)
    out = {kind: figures(timings[kind], walls[kind], None) for kind in VOICE_SYSTEMS}
    named, registered, no_reuse, inline = (out[k]["ttfa_p50_s"] for k in VOICE_SYSTEMS)
    ratios = {
        "registered/named": round(registered / named, 4),
        "registered_no_reuse/registered": round(no_reuse / registered, 4),
        "inline/registered": round(inline / registered, 4),
    }
    aims = [
        aim_entry(
            "registered cloned voice: TTFA p50 <= 1.2x a named speaker's",
            1.2,
            ratios["registered/named"],
            compare="<=",
            system="registered",
        ),
        aim_entry(
            "registered cloned voice: TTFA p50 at least 2x lower than cloning inline",
            2.0,
            ratios["inline/registered"],
            system="registered",
        ),
    ]
    return {
        "reference_seconds": REFERENCE_SECONDS,
        "reference_frames": record.frames,
        "kept_prompt_rows": kept_rows,
        "reused_prompt_rows": reused,
        "systems": out,
        "ratios": ratios,
        "aims": aims,
    }
