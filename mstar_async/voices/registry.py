"""The voice registry: a cloned voice's speaker embedding and reference codes, computed once.

``register`` checks every limit before any work (room in the store, the recording's length
and the labels' sizes), decodes and resamples the recording to the model's rate, runs the
model's encoders once (a request of its program with ``encode_only``) and stores the result.
``voice(id)`` gives a request the stored tensors, from memory after the first use in this
process; a voice deleted by another process sharing the directory is noticed through the
index. Nothing here names a file from a client's input: ids are the store's.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import anyio
import numpy as np
import torch

from mstar_async.errors import VoiceError, VoiceLimitError, VoiceNotFound
from mstar_async.voices.store import StoredVoice, VoiceRecord, VoiceStore

__all__ = ["VoiceRegistry", "decode_audio"]


def decode_audio(data: bytes, *, max_seconds: float) -> tuple[torch.Tensor, int]:
    """Decode an audio file (WAV, FLAC, Ogg, MP3: what libsndfile reads) to mono float PCM.
    Synchronous. The length is read from the header and checked before the samples are.

    Raises:
        VoiceError: not an audio file libsndfile reads, or empty.
        VoiceLimitError: longer than ``max_seconds``.
    """
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            seconds = f.frames / f.samplerate if f.samplerate else 0.0
            if seconds > max_seconds:
                raise VoiceLimitError(
                    f"the reference audio lasts {seconds:.1f} s; at most {max_seconds:g} s "
                    "is allowed: cut it shorter"
                )
            samples = f.read(dtype="float32", always_2d=True)
            rate = int(f.samplerate)
    except (RuntimeError, soundfile.LibsndfileError, TypeError) as exc:
        raise VoiceError(
            f"the reference audio is not an audio file this server reads (WAV, FLAC, Ogg, MP3): "
            f"{exc}"
        ) from None
    if not samples.size:
        raise VoiceError("the reference audio holds no samples")
    return torch.from_numpy(np.ascontiguousarray(samples.mean(axis=1))), rate


def _resample(pcm: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    if rate == target:
        return pcm.float()
    import soxr

    out = soxr.resample(pcm.float().numpy(), rate, target)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


class VoiceRegistry:
    """The voices of one model (``model``: its served name) in ``store``.

    Every process serving the same store directory sees the same voices. Tensors read from
    the store are cached in memory (at most ``store.limits.max_voices``, least recently used
    first out), so a voice costs one file read per process.
    """

    def __init__(self, store: VoiceStore, model: str) -> None:
        self.store = store
        self.model = model
        self._cache: OrderedDict[str, StoredVoice] = OrderedDict()

    def check(self, *, name: str, transcript: str | None, seconds: float | None = None) -> None:
        """Check a registration against every limit, before any work.

        Raises:
            VoiceError: an empty name.
            VoiceLimitError: the store is full, or a label or the recording is too long.
        """
        limits = self.store.limits
        if not name.strip():
            raise VoiceError("give the voice a name")
        if len(name) > limits.max_name_chars:
            raise VoiceLimitError(
                f"the voice name has {len(name)} characters; at most {limits.max_name_chars}"
            )
        if transcript is not None and len(transcript) > limits.max_transcript_chars:
            raise VoiceLimitError(
                f"the transcript has {len(transcript)} characters; at most "
                f"{limits.max_transcript_chars}"
            )
        if seconds is not None and seconds > limits.max_audio_seconds:
            raise VoiceLimitError(
                f"the reference audio lasts {seconds:.1f} s; at most "
                f"{limits.max_audio_seconds:g} s is allowed: cut it shorter"
            )
        self.store.check_room()

    async def register(
        self,
        runtime: Any,
        audio: torch.Tensor,
        sample_rate: int,
        *,
        name: str,
        transcript: str | None = None,
    ) -> VoiceRecord:
        """Compute the voice of ``audio`` (mono PCM at ``sample_rate``) once and store it.

        With a ``transcript`` the reference codes are kept for in-context cloning; without,
        the speaker embedding alone (upstream's x-vector mode). Cancel-safe: cancelled while
        the model runs, nothing is stored; once the store write has started it completes.

        Raises:
            VoiceError: the model cannot clone voices, or an empty name or recording.
            VoiceLimitError: a limit is passed (nothing computed).
            RequestError: the model failed on the recording.
        """
        transcript = transcript.strip() if transcript else None
        self.check(name=name, transcript=transcript, seconds=audio.numel() / sample_rate)
        info = runtime.model.info
        if not info.get("clones_voices"):
            raise VoiceError(f"model {self.model!r} cannot clone voices")
        if not audio.numel():
            raise VoiceError("the reference audio holds no samples")
        pcm = _resample(audio.reshape(-1), sample_rate, int(info["sample_rate"]))
        inputs = {"text": "", "ref_audio": pcm, "encode_only": True}
        inputs.update({"ref_text": transcript} if transcript else {"x_vector_only": True})
        async with runtime.generate(**inputs) as outputs:
            made = [item async for item in outputs]
        if len(made) != 1:
            raise VoiceError(f"model {self.model!r} made no voice from the recording")
        voice = made[0]
        return await anyio.to_thread.run_sync(
            lambda: self.store.add(
                name=name.strip(),
                model=self.model,
                speaker=voice.speaker,
                codes=voice.codes,
                transcript=transcript,
            )
        )

    def list(self) -> list[VoiceRecord]:
        """This model's voices, oldest first."""
        return [r for r in self.store.records() if r.model == self.model]

    async def delete(self, voice_id: str, runtime: Any = None) -> VoiceRecord:
        """Remove a voice and its file, then, given the ``runtime`` serving the model (one whose
        ``info["keeps_voice_kv"]``), the KV its talker keeps for the voice, on every replica
        (a request of its program with ``forget_voice``, which runs the drop on each with
        ``RequestContext.run_on_replicas``). Runs the file work in a thread; completes even if
        cancelled once started.

        Raises:
            VoiceNotFound: no such voice of this model.
        """
        self._owned(voice_id)
        self._cache.pop(voice_id, None)
        with anyio.CancelScope(shield=True):
            record = await anyio.to_thread.run_sync(self.store.delete, voice_id)
            if runtime is not None and runtime.model.info.get("keeps_voice_kv"):
                async with runtime.generate(text="", forget_voice=voice_id) as outputs:
                    async for _ in outputs:
                        pass
        return record

    async def voice(self, voice_id: str) -> StoredVoice:
        """The stored tensors of ``voice_id`` (cached after the first read here).

        Raises:
            VoiceNotFound: no such voice of this model (or deleted by another process).
        """
        self._owned(voice_id)
        cached = self._cache.get(voice_id)
        if cached is None:
            cached = await anyio.to_thread.run_sync(self.store.load, voice_id)
            self._cache[voice_id] = cached
            while len(self._cache) > self.store.limits.max_voices:
                self._cache.popitem(last=False)
        self._cache.move_to_end(voice_id)
        return cached

    def _owned(self, voice_id: str) -> VoiceRecord:
        record = self.store.record(voice_id)
        if record.model != self.model:
            self._cache.pop(voice_id, None)
            raise VoiceNotFound(f"voice {voice_id!r} belongs to model {record.model!r}")
        return record
