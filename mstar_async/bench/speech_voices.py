"""The cloned-voice rows of ``mstar bench speech --model qwen3-tts``.

Three kinds of request speak the same texts on the same runtime, interleaved round by round so
a shared machine's drift meets each alike: ``named`` (a built-in speaker), ``registered`` (a
voice cloned in context, computed once by the voice registry: the request reads its stored
embedding and reference codes) and ``inline`` (the same recording sent with every request:
both encoders run per request, as without a registry). The aims compare their time to first
audio: a registered voice within 1.2x of a named one, and at least 2x faster than inline.
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from mstar_async.bench.report import aim_entry
from mstar_async.voices import VoiceRegistry, VoiceStore

__all__ = ["VOICE_SYSTEMS", "measure_voices", "reference_recording"]

VOICE_SYSTEMS = ("named", "registered", "inline")
#: Seconds of reference audio: a typical cloning prompt (upstream suggests a few seconds).
REFERENCE_SECONDS = 6.0
_TRANSCRIPT = "This is the reference recording of the voice to clone, read aloud."


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
    ratios and the two aims. The recording is registered once, in a temporary store.

    Raises:
        RuntimeError: a request made no audio.
    """
    pcm = reference_recording()
    with tempfile.TemporaryDirectory(prefix="mstar-bench-voices-") as folder:
        registry = VoiceRegistry(VoiceStore(folder), runtime.model.name)
        record = await registry.register(runtime, pcm, 24_000, name="bench", transcript=_TRANSCRIPT)
        voice = await registry.voice(record.id)
        kinds: dict[str, dict[str, Any]] = {
            "named": {"speaker": "ryan"},
            "registered": {"voice": voice},
            "inline": {"ref_audio": pcm, "ref_text": _TRANSCRIPT},
        }
        timings: dict[str, list[Any]] = {kind: [] for kind in VOICE_SYSTEMS}
        walls: dict[str, float] = dict.fromkeys(VOICE_SYSTEMS, 0.0)
        for i, base in enumerate(requests):
            shift = i % len(VOICE_SYSTEMS)
            for kind in (*VOICE_SYSTEMS[shift:], *VOICE_SYSTEMS[:shift]):
                timing = await stream_one(runtime, {**base, **kinds[kind]})
                timings[kind].append(timing)
                walls[kind] += timing.e2e_s
        await registry.delete(record.id)
    out = {kind: figures(timings[kind], walls[kind], None) for kind in VOICE_SYSTEMS}
    named, registered, inline = (out[k]["ttfa_p50_s"] for k in VOICE_SYSTEMS)
    ratios = {
        "registered/named": round(registered / named, 4),
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
        "systems": out,
        "ratios": ratios,
        "aims": aims,
    }
