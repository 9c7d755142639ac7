"""Registered voices on disk: one safetensors file per voice and a small JSON index.

Layout of the directory the server is given::

    index.json            {"version": 1, "voices": {id: {name, model, transcript, ...}}}
    voice_<24 hex>.safetensors   "speaker" [hidden] float32, "codes" [frames, G] int64 (if any)
    .lock                 held (flock) while the index or a file changes

Why this shape: ids are generated here (``secrets``), never taken from a request, and files are
named by id only, so nothing a client sends names a file; a client-given name is a label in the
index. Every change writes a temporary file and ``os.replace``s it, so a crash leaves the old or
the new index, never half of one; files the index does not list (a crash between the two
writes, a voice deleted by another process mid-read) are swept on open. Every process serving
the same directory (replicas, ranks on one host or a shared filesystem) sees the same voices:
readers reload the index when its modification time or size changes. Pure and synchronous;
callers off the event loop thread run it in a worker thread.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mstar_async.errors import VoiceLimitError, VoiceNotFound

__all__ = ["StoredVoice", "VoiceLimits", "VoiceRecord", "VoiceStore", "valid_id"]

_ID = re.compile(r"^voice_[0-9a-f]{24}$")
_INDEX = "index.json"


def valid_id(voice_id: str) -> bool:
    """Whether ``voice_id`` has the form this store generates (and so can name no other
    file)."""
    return bool(_ID.match(voice_id))


@dataclass(frozen=True)
class VoiceLimits:
    """Bounds on the registry, checked before any work.

    Attributes:
        max_voices: voices held at once.
        max_audio_seconds: length of one reference recording.
        max_upload_bytes: size of one uploaded audio file.
        max_name_chars / max_transcript_chars: lengths of the labels.
    """

    max_voices: int = 100
    max_audio_seconds: float = 30.0
    max_upload_bytes: int = 16 * 2**20
    max_name_chars: int = 64
    max_transcript_chars: int = 2000

    def __post_init__(self) -> None:
        """Raises ValueError: a bound below 1."""
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"VoiceLimits.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class VoiceRecord:
    """A registered voice's index entry."""

    id: str
    name: str
    model: str
    created_at: int
    transcript: str | None
    frames: int
    bytes: int

    def public(self) -> dict[str, Any]:
        """The entry as the HTTP API shows it."""
        return {"object": "audio.voice", **asdict(self)}


@dataclass(frozen=True)
class StoredVoice:
    """A registered voice's tensors: ``speaker`` ``[hidden]`` and ``codes`` ``[frames, G]``
    (``None``: embedding only), with its ``transcript`` and ``id``."""

    speaker: torch.Tensor
    codes: torch.Tensor | None
    transcript: str | None
    id: str | None = None


class VoiceStore:
    """The voices of one directory (created if absent).

    Raises:
        ValueError: ``directory`` exists and is not a directory.
    """

    def __init__(self, directory: str | Path, limits: VoiceLimits | None = None) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"voice store {self.directory} is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limits = limits or VoiceLimits()
        self._index: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[int, int] | None = None
        with self._locked():
            self._reload(force=True)
            self._sweep()

    # ------------------------------------------------------------------ reads

    def records(self) -> list[VoiceRecord]:
        """Every voice, oldest first."""
        self._reload()
        # The index keeps insertion order (a JSON object's keys, as written).
        return [self._record(k, v) for k, v in self._index.items()]

    def record(self, voice_id: str) -> VoiceRecord:
        """The index entry of ``voice_id``.

        Raises:
            VoiceNotFound: no such voice (or not an id this store makes).
        """
        self._reload()
        entry = self._index.get(voice_id) if valid_id(voice_id) else None
        if entry is None:
            raise VoiceNotFound(f"no voice {voice_id!r}; list them with GET /v1/audio/voices")
        return self._record(voice_id, entry)

    def load(self, voice_id: str) -> StoredVoice:
        """The tensors of ``voice_id`` (read from its file). Blocks on the read.

        Raises:
            VoiceNotFound: no such voice, or it was deleted meanwhile.
        """
        record = self.record(voice_id)
        try:
            tensors = load_file(self.directory / f"{record.id}.safetensors")
        except FileNotFoundError:
            raise VoiceNotFound(f"voice {voice_id!r} was deleted") from None
        return StoredVoice(tensors["speaker"], tensors.get("codes"), record.transcript, record.id)

    def __len__(self) -> int:
        self._reload()
        return len(self._index)

    # ------------------------------------------------------------------ writes

    def check_room(self) -> None:
        """Raise if one more voice would pass ``max_voices`` (before any work is done).

        Raises:
            VoiceLimitError: the store is full.
        """
        self._reload()
        if len(self._index) >= self.limits.max_voices:
            raise VoiceLimitError(
                f"the voice registry holds its limit of {self.limits.max_voices} voices; "
                "delete one (DELETE /v1/audio/voices/{id}) first"
            )

    def add(
        self,
        *,
        name: str,
        model: str,
        speaker: torch.Tensor,
        codes: torch.Tensor | None,
        transcript: str | None,
    ) -> VoiceRecord:
        """Store a voice under a new id. Blocks on the writes.

        Raises:
            VoiceLimitError: the store is full (checked again under the lock).
        """
        voice_id = "voice_" + secrets.token_hex(12)
        tensors = {"speaker": speaker.detach().float().cpu().contiguous()}
        if codes is not None:
            tensors["codes"] = codes.detach().long().cpu().contiguous()
        path = self.directory / f"{voice_id}.safetensors"
        with self._locked():
            self._reload(force=True)
            self.check_room()
            tmp = path.with_suffix(".tmp")
            save_file(tensors, tmp)
            os.replace(tmp, path)
            entry = {
                "name": name,
                "model": model,
                "created_at": int(time.time()),
                "transcript": transcript,
                "frames": 0 if codes is None else int(codes.shape[0]),
                "bytes": path.stat().st_size,
            }
            index = dict(self._index)
            index[voice_id] = entry
            try:
                self._write(index)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        return self._record(voice_id, entry)

    def delete(self, voice_id: str) -> VoiceRecord:
        """Remove ``voice_id``: its index entry, then its file.

        Raises:
            VoiceNotFound: no such voice.
        """
        with self._locked():
            self._reload(force=True)
            record = self.record(voice_id)
            index = dict(self._index)
            del index[voice_id]
            self._write(index)
            (self.directory / f"{voice_id}.safetensors").unlink(missing_ok=True)
        return record

    def files(self) -> list[str]:
        """Names of the files in the directory (tests: nothing is left behind)."""
        return sorted(p.name for p in self.directory.iterdir())

    # ------------------------------------------------------------------ internals

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _reload(self, *, force: bool = False) -> None:
        path = self.directory / _INDEX
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._index, self._stamp = {}, None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if not force and stamp == self._stamp:
            return
        data = json.loads(path.read_text())
        voices = data.get("voices", {}) if isinstance(data, dict) else {}
        self._index = {k: v for k, v in voices.items() if valid_id(k) and isinstance(v, dict)}
        self._stamp = stamp

    def _write(self, index: dict[str, dict[str, Any]]) -> None:
        path = self.directory / _INDEX
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "voices": index}, indent=1))
        os.replace(tmp, path)
        self._index = index
        stat = path.stat()
        self._stamp = (stat.st_mtime_ns, stat.st_size)

    def _sweep(self) -> None:
        """Remove voice files the index does not list and temporary files (a crash's
        leftovers); called under the lock."""
        for path in self.directory.iterdir():
            stem = path.name.split(".")[0]
            orphan = path.suffix == ".safetensors" and stem not in self._index
            if orphan or path.suffix == ".tmp":
                path.unlink(missing_ok=True)

    @staticmethod
    def _record(voice_id: str, entry: dict[str, Any]) -> VoiceRecord:
        return VoiceRecord(
            id=voice_id,
            name=str(entry.get("name", "")),
            model=str(entry.get("model", "")),
            created_at=int(entry.get("created_at", 0)),
            transcript=entry.get("transcript"),
            frames=int(entry.get("frames", 0)),
            bytes=int(entry.get("bytes", 0)),
        )
