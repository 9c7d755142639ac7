"""A Pipecat text-to-speech service that speaks through an mstar_async ``Runtime`` in-process.

``MstarTTSService`` sits where any Pipecat TTS service sits (after the LLM, before the output
transport). Each sentence Pipecat aggregates becomes one ``runtime.generate(text=..., voice=...)``
request; its ``AudioChunk``s go out as ``TTSAudioRawFrame``s (16-bit mono PCM at the pipeline's
output rate, resampled as a stream when that differs from the model's) as soon as they are made.

Barge-in: an ``InterruptionFrame`` cancels every interruptible utterance in flight. Pipecat
cancels ``run_tts``, whose closing waits until the runtime has released the request (KV blocks
back in the pool), before the frame travels on, and drops the audio already queued, so nothing
of an interrupted utterance plays after it; the service then also waits for any utterance not
released by then.

Needs ``pip install 'mstar-async[voice]'`` (the ``pipecat-ai`` package).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any

try:
    from pipecat.frames.frames import (
        CancelFrame,
        EndFrame,
        ErrorFrame,
        Frame,
        InterruptionFrame,
        StartFrame,
        TTSAudioRawFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TTSService
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    raise ModuleNotFoundError(
        "mstar_async.integrations.pipecat needs Pipecat: pip install 'mstar-async[voice]' "
        f"(missing module {exc.name!r})"
    ) from exc

from mstar_async.conductor import RequestStream
from mstar_async.errors import RequestCancelled, RequestError
from mstar_async.graph import Model
from mstar_async.integrations.pcm import PcmConverter
from mstar_async.logs import get_logger
from mstar_async.outputs import AudioChunk
from mstar_async.runtime import Runtime, open_runtime

__all__ = ["MstarTTSService"]

log = get_logger("mstar_async.integrations.pipecat")


class MstarTTSService(TTSService):
    """Pipecat TTS through an mstar_async speech model (e.g. ``orpheus``), in this process.

    Give either ``runtime``, an open ``Runtime`` the application owns (it outlives the
    pipeline; the service never closes it), or ``model``, which the service opens with
    ``open_runtime(model, **runtime_options)`` when the pipeline starts and closes when it
    ends or is cancelled. ``voice`` is passed to every request as ``voice=`` (``None``: not
    passed, the model's default); ``inputs`` are further request inputs (``seed``,
    ``temperature``, ``max_tokens`` for orpheus). ``sample_rate`` fixes the output rate;
    by default it is the pipeline's ``audio_out_sample_rate``. Other keyword arguments go to
    Pipecat's ``TTSService`` (e.g. ``text_aggregation_mode``).

    Raises:
        ValueError: neither or both of ``runtime`` and ``model`` were given.
    """

    def __init__(
        self,
        *,
        runtime: Runtime | None = None,
        model: Model | None = None,
        runtime_options: Mapping[str, Any] | None = None,
        voice: str | None = None,
        inputs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if (runtime is None) == (model is None):
            raise ValueError(
                "give MstarTTSService either runtime= (an open Runtime the app owns) or "
                "model= (the service opens and closes its own runtime), not both or neither"
            )
        served = runtime.model if runtime is not None else model
        assert served is not None
        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            settings=TTSSettings(model=served.name, voice=voice, language=None),
            **kwargs,
        )
        self._runtime = runtime
        options = dict(runtime_options or {})
        self._owned = _OwnedRuntime(model, options) if model is not None else None
        self._inputs = dict(inputs or {})
        self._streams: dict[str, tuple[str, RequestStream]] = {}  # request id -> context, stream

    @property
    def runtime(self) -> Runtime:
        """The runtime requests go to.

        Raises:
            RuntimeError: the service owns its runtime and the pipeline has not started it.
        """
        if self._runtime is None:
            raise RuntimeError("the service's runtime opens when the pipeline starts")
        return self._runtime

    @property
    def active_requests(self) -> int:
        """How many utterances are being synthesised now."""
        return len(self._streams)

    def can_generate_metrics(self) -> bool:
        """TTFB (first audio), TTFA and usage metrics are reported."""
        return True

    async def start(self, frame: StartFrame) -> None:
        """Start the service; open its own runtime if it was given a model.

        Raises:
            Whatever ``open_runtime`` raises while building the model's engines.
        """
        await super().start(frame)
        if self._owned is not None and self._runtime is None:
            self._runtime = await self._owned.open()

    async def stop(self, frame: EndFrame) -> None:
        """Finish queued speech, then close the runtime the service owns."""
        await super().stop(frame)
        await self._shutdown()

    async def cancel(self, frame: CancelFrame) -> None:
        """Cancel speech in flight and close the runtime the service owns."""
        await super().cancel(frame)
        await self._shutdown()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """Pipecat's TTS frame handling, plus barge-in: an ``InterruptionFrame`` cancels the
        interruptible utterances in flight, and this returns once the runtime released them."""
        if not isinstance(frame, InterruptionFrame):
            await super().process_frame(frame, direction)
            return
        interrupted = [s for c, s in self._streams.values() if self._interruptible(c)]
        for stream in interrupted:
            stream.cancel()  # stops the request at its next step, before Pipecat's own unwinding
        await super().process_frame(frame, direction)
        for stream in interrupted:
            await stream.aclose()

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Synthesise ``text`` as one request, yielding its audio as it is made.

        A failed request yields an ``ErrorFrame``; a cancelled one ends quietly. Safe to cancel:
        the request is cancelled and released before the generator finishes closing.
        """
        voice = self._settings.voice
        inputs = dict(self._inputs)
        if isinstance(voice, str):
            inputs["voice"] = voice
        await self.start_tts_usage_metrics(text)
        try:
            stream = self.runtime.generate(text=text, **inputs)
        except RequestError as exc:
            yield ErrorFrame(error=f"{self}: {exc}")
            return
        self._streams[stream.request_id] = (context_id, stream)
        converter = PcmConverter(self.sample_rate)
        try:
            async for item in stream:
                if isinstance(item, AudioChunk):
                    audio = converter.convert(item)
                    if audio:
                        yield self._audio_frame(audio, context_id)
            tail = converter.finish()
            if tail:
                yield self._audio_frame(tail, context_id)
        except RequestCancelled:
            log.debug("tts.cancelled", request_id=stream.request_id)
        except RequestError as exc:
            yield ErrorFrame(error=f"{self}: {exc}")
        finally:
            self._streams.pop(stream.request_id, None)
            await stream.aclose()

    def _audio_frame(self, audio: bytes, context_id: str) -> TTSAudioRawFrame:
        return TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)

    def _interruptible(self, context_id: str) -> bool:
        # Pipecat keeps a context of a TTSSpeakFrame(interruptible=False) playing through an
        # interruption; its per-context record is the only place that says so.
        context = getattr(self, "_tts_contexts", {}).get(context_id)
        return context is None or bool(context.interruptible)

    async def _shutdown(self) -> None:
        for _, stream in list(self._streams.values()):
            await stream.aclose()
        self._streams.clear()
        if self._owned is not None and self._runtime is not None:
            self._runtime = None
            await self._owned.close()


class _OwnedRuntime:
    """A runtime opened and closed by one task of its own: Pipecat starts and stops a service
    from different tasks, and a runtime's task groups must be left by the task that entered
    them."""

    def __init__(self, model: Model, options: dict[str, Any]) -> None:
        self._model = model
        self._options = options
        self._task: asyncio.Task[None] | None = None
        self._opened: asyncio.Future[Runtime] | None = None
        self._closing = asyncio.Event()

    async def open(self) -> Runtime:
        self._opened = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._task = asyncio.create_task(self._hold(self._opened), name="mstar runtime")
        return await asyncio.shield(self._opened)

    async def close(self) -> None:
        if self._task is None:
            return
        self._closing.set()
        task, self._task = self._task, None
        await asyncio.shield(task)

    async def _hold(self, opened: asyncio.Future[Runtime]) -> None:
        try:
            async with open_runtime(self._model, **self._options) as runtime:
                opened.set_result(runtime)
                await self._closing.wait()
        except BaseException as exc:
            if opened.done():
                raise
            # Failing to open is reported by open(), not as an unretrieved task error.
            if isinstance(exc, asyncio.CancelledError):
                opened.cancel()
                raise
            opened.set_exception(exc)
