"""``open_runtime``: everything one model needs to serve, inside the host's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from mstar_async.conductor import Conductor, RequestStream
from mstar_async.conductor.conductor import unwrap
from mstar_async.conductor.dispatch import PlacedExecutor
from mstar_async.graph import Model
from mstar_async.logs import get_logger
from mstar_async.placement import Placement
from mstar_async.runtime.session import SpeechSession
from mstar_async.runtime.stats import RuntimeStats, in_process_stats, pool_stats
from mstar_async.voices import VoiceRecord, VoiceRegistry, VoiceStore
from mstar_async.worker.launchers import Launcher
from mstar_async.worker.pool import WorkerPool
from mstar_async.worker.settings import RuntimeSettings
from mstar_async.worker.walk_loop import WalkLoop, build_engines

log = get_logger("mstar_async.runtime")


class Runtime:
    """A running model: its conductor and what runs its steps, either a batching loop in this
    process (``batching``) or worker processes (``pool``).

    Obtain one from ``open_runtime``; it lives as long as that ``async with`` block.
    """

    def __init__(
        self,
        model: Model,
        conductor: Conductor,
        *,
        batching: WalkLoop | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        self.model = model
        self.conductor = conductor
        self._batching = batching
        self.pool = pool
        #: The model's registered voices (``open_runtime(voices=...)``), or None.
        self.voices: VoiceRegistry | None = None

    @property
    def batching(self) -> WalkLoop:
        """The in-process batching loop.

        Raises:
            RuntimeError: this runtime runs its steps in worker processes.
        """
        if self._batching is None:
            raise RuntimeError("this runtime runs its steps in worker processes: see .pool")
        return self._batching

    async def stats(self) -> RuntimeStats:
        """What every rank runs and holds now (running walks, waiting steps, KV blocks used
        and total, forwards and batch sizes, restarts; rank 0 alone in process), and the
        conductor's requests and what went through it. A worker rank that is starting,
        restarting, down or slower than half a second to answer is reported ``up=False`` with
        why. Cancel-safe; never raises.
        """
        requests = len(self.conductor.active)
        if self.pool is None:
            return in_process_stats(self.batching, requests)
        return await pool_stats(self.pool, requests)

    def generate(self, *, request_id: str | None = None, **inputs: Any) -> RequestStream:
        """Start a request and return its outputs as an async iterator (close it, or use
        ``async with``). Many requests may run at once, from any task of the host loop.

        Raises:
            RequestError: the inputs do not fit the model's request program.
        """
        return self.conductor.generate(request_id=request_id, **inputs)

    def speech_session(
        self,
        *,
        text_input: str = "text",
        lookahead: int = 1,
        session_id: str | None = None,
        **inputs: Any,
    ) -> SpeechSession:
        """Open a session that voices text pushed piece by piece, one request per segment.

        ``inputs`` go to every segment's request beside the segment's text, which fills the
        program's ``text_input`` argument; ``lookahead`` is how many segments after the one
        being read may be synthesised ahead. See ``SpeechSession``.

        Raises:
            RequestError: the model's program takes no ``text_input`` or not these inputs.
            ValueError: ``lookahead`` is negative.
        """
        return SpeechSession(
            self.conductor,
            inputs,
            text_input=text_input,
            lookahead=lookahead,
            session_id=session_id,
        )

    async def register_voice(
        self,
        audio: Any,
        sample_rate: int = 24_000,
        *,
        name: str,
        transcript: str | None = None,
    ) -> VoiceRecord:
        """Compute a cloned voice once from ``audio`` (mono PCM at ``sample_rate``, or the
        bytes of an audio file) and store it; pass ``voice=await runtime.voice(id)`` to
        ``generate`` to speak in it. See ``VoiceRegistry.register`` (cancel-safe: nothing is
        stored if cancelled before the write).

        Raises:
            RuntimeError: the runtime was opened without ``voices``.
            VoiceError, VoiceLimitError: as ``VoiceRegistry.register``.
        """
        registry = self._registry()
        if isinstance(audio, bytes):
            from mstar_async.voices import decode_audio

            audio, sample_rate = decode_audio(
                audio, max_seconds=registry.store.limits.max_audio_seconds
            )
        return await registry.register(self, audio, sample_rate, name=name, transcript=transcript)

    async def voice(self, voice_id: str) -> Any:
        """A registered voice's tensors, for ``generate(voice=...)``.

        Raises:
            RuntimeError: no ``voices``; VoiceNotFound: no such voice.
        """
        return await self._registry().voice(voice_id)

    def list_voices(self) -> list[VoiceRecord]:
        """The registered voices of this model. Raises RuntimeError without ``voices``."""
        return self._registry().list()

    async def delete_voice(self, voice_id: str) -> VoiceRecord:
        """Remove a registered voice, its file and the KV kept for it.

        Raises:
            RuntimeError: no ``voices``; VoiceNotFound: no such voice.
        """
        return await self._registry().delete(voice_id, self)

    def _registry(self) -> VoiceRegistry:
        if self.voices is None:
            raise RuntimeError("open the runtime with voices=<directory> to register voices")
        return self.voices


@asynccontextmanager
async def open_runtime(
    model: Model,
    *,
    placement: Placement | None = None,
    settings: RuntimeSettings | None = None,
    launcher: Launcher | None = None,
    voices: str | Path | VoiceStore | None = None,
) -> AsyncIterator[Runtime]:
    """Serve ``model`` until the block exits.

    Without ``placement`` every engine is built in this process and one batching loop runs
    them. With one, each rank is a worker process that builds the engines placed on it (the
    model must come from the zoo's ``build_model`` or carry a ``source``), and each node step
    goes to the rank placement names. ``launcher`` starts those workers: child processes of
    this one by default, or e.g. ``RayLauncher("auto")`` for Ray actors across a cluster (see
    ``mstar_async.worker.launchers``), or ``RemoteLauncher.for_placement(placement)`` for
    ranks that ``mstar worker`` processes on other hosts serve, joined over plain TCP (see
    ``mstar_async.worker.remote``); it needs a placement.

    Runs in whatever event loop is already running (asyncio or uvloop); it never creates or
    replaces one. Leaving the block cancels requests still running and stops every worker.
    ``settings`` (``RuntimeSettings``: batch limits, the forward time bound, worker threads)
    reach every rank alike: a long prefill is cut into chunks whose forward stays under the
    time bound, or under a decode round and a quarter where one nears it, so a cancel frees
    memory promptly and running requests keep their pace (see ``ForwardTimer``). ``voices`` is the
    directory (or store) of registered voices, for models that clone voices
    (``runtime.register_voice``).

    Raises:
        PlacementError: the placement does not fit the model.
        ValueError: a placement was given for a model that no other process can rebuild, or a
            launcher without a placement.
        WorkerLost: a worker failed to start.
        Whatever a component factory raises while building its engine in this process.
    """
    settings = settings or RuntimeSettings()
    if launcher is not None and placement is None:
        raise ValueError("a launcher starts worker ranks: pass a placement too")
    store = voices if isinstance(voices, VoiceStore) or voices is None else VoiceStore(voices)
    registry = None if store is None else VoiceRegistry(store, model.name)
    try:
        if placement is None:
            async with _in_process(model, settings) as runtime:
                runtime.voices = registry
                yield runtime
        else:
            async with _with_workers(model, placement, settings, launcher) as runtime:
                runtime.voices = registry
                yield runtime
    except BaseExceptionGroup as group:
        # The caller's own exception, not a group our task groups wrapped around it.
        raise unwrap(group) from None


@asynccontextmanager
async def _in_process(model: Model, settings: RuntimeSettings) -> AsyncIterator[Runtime]:
    thread, engines = await build_engines(model.components)
    batching = WalkLoop(
        engines,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        forward_time_bound_s=settings.forward_time_bound_s,
        forward_thread=thread,
    )
    log.info("runtime.open", model=model.name, engines=sorted(engines))
    async with anyio.create_task_group() as tg:
        await tg.start(batching.run)
        try:
            async with Conductor(model, batching, walks=batching) as conductor:
                yield Runtime(model, conductor, batching=batching)
        finally:
            tg.cancel_scope.cancel()
    log.info("runtime.close", model=model.name)


@asynccontextmanager
async def _with_workers(
    model: Model,
    placement: Placement,
    settings: RuntimeSettings,
    launcher: Launcher | None,
) -> AsyncIterator[Runtime]:
    resolved = placement.validate(model)
    if model.source is None:
        raise ValueError(
            f"model {model.name!r} has no source, so worker processes cannot rebuild it: build "
            "it with mstar_async.models.build_model, or set model.source = ModelSource(...)"
        )
    engines_on = {rank: resolved.engines_on(rank) for rank in range(resolved.ranks)}
    log.info("runtime.open", model=model.name, ranks=resolved.ranks)
    async with WorkerPool(
        model.source,
        engines_on,
        settings=settings,
        launcher=launcher,
    ) as pool:
        executor = PlacedExecutor(resolved, pool)
        async with Conductor(model, executor, walks=executor) as conductor:
            yield Runtime(model, conductor, pool=pool)
    log.info("runtime.close", model=model.name)
