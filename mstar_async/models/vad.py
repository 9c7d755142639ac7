"""``silero-vad``: speech probability per 32 ms frame of a 16 kHz audio stream, batched across
streams (one request per stream; a realtime session's microphone is one).

Graph: one node, ``vad [vad]``, fed by the walk input ``vad.audio`` through a
``LeftContextChunkPolicy(512, 64)``: each chunk is a frame of 512 new samples after the previous
frame's last 64, as Silero takes them. The program yields one float per frame, in order; the
frame count is ``ceil(samples / 512)`` (a short last frame is padded with silence).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

from mstar_async.graph import Model, Node, Walk
from mstar_async.models.registry import register
from mstar_async.policies import LeftContextChunkPolicy
from mstar_async.realtime.vad import CONTEXT, FRAME, VADEngine

MAX_BUFFER = 64
"""Frames (2 s of audio) a stream may run ahead of the VAD before its feeder is held."""


async def _listen(request: Any, audio: AsyncIterable[Any]) -> AsyncGenerator[float, None]:
    async with request.stream("listen", audio=audio) as events:
        async for event in events:
            yield float(event.value)


@register("silero-vad", "Silero VAD: speech probability per 32 ms of a 16 kHz stream")
def build_vad() -> Model:
    """Build the VAD model (the weights come with the ``silero-vad`` package).

    Raises:
        VADWeightsMissing: when its engine is built without the package installed.
    """
    node = Node("vad", engine="vad", op="detect", inputs=["audio"], outputs=["speech"])
    walk = Walk(
        "listen",
        "vad",
        streams={"vad.audio": LeftContextChunkPolicy(FRAME, CONTEXT)},
        outputs=["vad.speech"],
        max_buffer=MAX_BUFFER,
    )
    return Model(
        "silero-vad",
        nodes=[node],
        walks=[walk],
        program=_listen,
        components={"vad": VADEngine},
        description="Silero VAD over a streamed 16 kHz input, one probability per 32 ms frame",
    )
