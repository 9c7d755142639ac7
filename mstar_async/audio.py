"""Audio out: a stream of ``AudioChunk``s as raw PCM, WAV, FLAC, Ogg, MP3 or Opus bytes, or a file.

- ``AudioEncoder(format)``: ``encode(chunk) -> bytes`` per chunk, then ``finish() -> bytes``.
  The first chunk declares the sample rate (mono); a later chunk at another rate is an error.
- ``encode_stream(chunks, format)``: the same over an async iterable, as an async iterator.
- ``write_audio(path, chunks, format=None)``: a file, its format from the extension by default.

Formats (``FORMATS``): ``pcm_s16le`` and ``pcm_f32le`` (headerless little-endian samples),
``wav`` (16-bit PCM), ``flac`` (16-bit), ``ogg`` (Vorbis), ``mp3`` (MPEG layer III, constant
bitrate when streamed), ``opus`` (Ogg Opus; 8, 12, 16, 24 or 48 kHz only). Streamed WAV
carries the RIFF and data sizes as 0xFFFFFFFF ("unknown, read to the end"), the usual header
for a WAV of unknown length; a file written by ``write_audio`` has its exact sizes. Streamed
FLAC, Ogg and MP3 are produced by libsndfile (``soundfile``) as it writes them; their headers
say "length unknown". Ogg (Vorbis, Opus) comes out a page at a time, so its bytes lag the audio.
"""

from __future__ import annotations

import io
import struct
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar_async.outputs import AudioChunk

FORMATS = ("pcm_s16le", "pcm_f32le", "wav", "flac", "ogg", "mp3", "opus")
EXTENSIONS = {
    ".wav": "wav",
    ".flac": "flac",
    ".ogg": "ogg",
    ".pcm": "pcm_s16le",
    ".raw": "pcm_s16le",
    ".f32": "pcm_f32le",
    ".mp3": "mp3",
    ".opus": "opus",
}
_SOUNDFILE = {
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "VORBIS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
#: Streamed MP3 is constant-bitrate: libsndfile patches the VBR (Xing) frame count in only on
#: close, and without it a reader can size a VBR stream only from its first frame's bitrate.
#: libsndfile applies a bitrate mode only together with a compression level (0.5: ~96 kbit/s).
_BITRATE_MODE = {"mp3": ("CONSTANT", 0.5)}
_UNKNOWN_SIZE = 0xFFFFFFFF


def check_format(format: str) -> str:
    """Return ``format`` if it is one of ``FORMATS``.

    Raises:
        ValueError: naming the valid formats.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown audio format {format!r}; valid formats: {', '.join(FORMATS)}")
    return format


def format_for_path(path: str | Path) -> str:
    """The format a file name's extension stands for (``.wav``, ``.flac``, ``.ogg``, ``.pcm``,
    ``.raw``, ``.f32``).

    Raises:
        ValueError: the extension is none of those (the message lists them).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        valid = ", ".join(EXTENSIONS)
        raise ValueError(f"cannot tell the audio format of {str(path)!r}; use one of {valid}")
    return EXTENSIONS[suffix]


def to_s16le(pcm: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] (clipped) as 16-bit little-endian integers."""
    samples = pcm.detach().reshape(-1).float().clamp(-1.0, 1.0).mul(32767.0).round()
    return samples.to(torch.int16).numpy().astype("<i2").tobytes()


def to_f32le(pcm: torch.Tensor) -> bytes:
    """Float samples as 32-bit little-endian floats, unchanged."""
    return pcm.detach().reshape(-1).float().numpy().astype("<f4").tobytes()


def wav_header(sample_rate: int, data_bytes: int = _UNKNOWN_SIZE) -> bytes:
    """A 44-byte RIFF/WAVE header for mono 16-bit PCM; sizes 0xFFFFFFFF when unknown."""
    riff = _UNKNOWN_SIZE if data_bytes == _UNKNOWN_SIZE else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def _bitrate(format: str) -> dict[str, Any]:
    mode = _BITRATE_MODE.get(format)
    return {} if mode is None else {"bitrate_mode": mode[0], "compression_level": mode[1]}


class AudioEncoder:
    """Encodes one mono stream of ``AudioChunk``s into ``format`` bytes, chunk by chunk.

    Synchronous and not thread-safe; one encoder per stream. The constructor raises
    ``ValueError`` for an unknown format (naming the valid ones).
    """

    def __init__(self, format: str) -> None:
        self.format = check_format(format)
        self.sample_rate: int | None = None
        self._sink: io.BytesIO | None = None
        self._file: Any = None
        self._sent = 0
        self._finished = False

    def encode(self, chunk: AudioChunk) -> bytes:
        """The bytes for ``chunk`` (the header too, on the first chunk).

        Raises:
            ValueError: the chunk's sample rate differs from the first chunk's, or the encoder
                is finished.
        """
        if self._finished:
            raise ValueError("AudioEncoder.encode() after finish(): make a new encoder")
        head = self._start(chunk.sample_rate)
        if self.format == "pcm_f32le":
            return head + to_f32le(chunk.pcm)
        if self.format in ("pcm_s16le", "wav"):
            return head + to_s16le(chunk.pcm)
        self._file.write(chunk.pcm.detach().reshape(-1).float().numpy().astype(np.float32))
        return head + self._drain()

    def finish(self, sample_rate: int | None = None) -> bytes:
        """The closing bytes (compressed formats flush their last frames); idempotent.

        A stream that had no chunk gives no bytes; with ``sample_rate`` it gives a whole stream
        of no samples at that rate instead, so a reader sees a valid, empty file: a WAV header
        of size 0, a FLAC ``STREAMINFO`` alone, Ogg's header pages (headerless PCM and MP3,
        which is frames only, stay empty).
        """
        if self._finished:
            return b""
        head = b""
        if self.sample_rate is None and sample_rate is not None:
            if self.format in ("wav", "flac"):
                self._finished = True
                return (
                    wav_header(sample_rate, 0) if self.format == "wav" else _flac_empty(sample_rate)
                )
            head = self._start(sample_rate)
        self._finished = True
        if self._file is None:
            return head
        self._file.close()
        return head + self._drain()

    def _start(self, sample_rate: int) -> bytes:
        if self.sample_rate is not None:
            if sample_rate != self.sample_rate:
                raise ValueError(
                    f"audio chunk at {sample_rate} Hz in a {self.sample_rate} Hz stream: "
                    "resample it, or encode it as a separate stream"
                )
            return b""
        self.sample_rate = sample_rate
        if self.format == "wav":
            return wav_header(sample_rate)
        if self.format in _SOUNDFILE:
            import soundfile

            container, subtype = _SOUNDFILE[self.format]
            self._sink = io.BytesIO()
            self._file = soundfile.SoundFile(
                self._sink,
                "w",
                sample_rate,
                1,
                subtype=subtype,
                format=container,
                **_bitrate(self.format),
            )
        return b""

    def _drain(self) -> bytes:
        # libsndfile may seek back to patch a header it already wrote; a stream cannot take
        # those bytes back, so only what lies past the bytes already sent goes out.
        assert self._sink is not None
        data = self._sink.getvalue()[self._sent :]
        if self.format == "flac" and self._sent == 0 and len(data) >= _FLAC_TOTAL_END:
            data = _flac_length_unknown(data)
        self._sent += len(data)
        return data


# STREAMINFO follows "fLaC" and a 4-byte block header; its 64-bit big-endian word at byte 18
# ends with the 36-bit total sample count, where 0 means "unknown".
_FLAC_TOTAL_AT, _FLAC_TOTAL_END = 18, 26


def _flac_empty(sample_rate: int) -> bytes:
    # "fLaC", then one metadata block (the last: flag 0x80), STREAMINFO: block sizes 4096,
    # frame sizes unknown (0), the rate, mono, 16 bits, total samples 0, no MD5. libsndfile
    # writes nothing at all for a stream without samples.
    word = (sample_rate << 44) | (0 << 41) | (15 << 36)
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + struct.pack(">Q", word) + bytes(16)
    return b"fLaC" + b"\x80" + len(info).to_bytes(3, "big") + info


def _flac_length_unknown(data: bytes) -> bytes:
    # libsndfile writes a provisional total and patches it on close, which a stream cannot do;
    # 0 makes decoders read to the end instead of trusting a wrong length.
    (word,) = struct.unpack(">Q", data[_FLAC_TOTAL_AT:_FLAC_TOTAL_END])
    word &= ~((1 << 36) - 1)
    return data[:_FLAC_TOTAL_AT] + struct.pack(">Q", word) + data[_FLAC_TOTAL_END:]


async def encode_stream(chunks: AsyncIterable[AudioChunk], format: str) -> AsyncIterator[bytes]:
    """Yield ``format`` bytes as ``chunks`` arrive (empty pieces are skipped).

    Raises ``ValueError`` for an unknown format (before the first chunk is awaited) or a sample
    rate change. Safe to cancel: the encoder is dropped with the iterator.
    """
    encoder = AudioEncoder(format)
    async for chunk in chunks:
        if data := encoder.encode(chunk):
            yield data
    if tail := encoder.finish():
        yield tail


def write_audio(path: str | Path, chunks: Iterable[AudioChunk], format: str | None = None) -> int:
    """Write ``chunks`` to ``path`` (format from the extension unless given); return the number
    of samples written. WAV, FLAC and Ogg files get exact headers.

    Raises:
        ValueError: an unknown format or extension, a sample rate change, or no chunks at all.
        OSError: the file cannot be written.
    """
    fmt = check_format(format) if format is not None else format_for_path(path)
    items = iter(chunks)
    first = next(items, None)
    if first is None:
        raise ValueError(f"no audio to write to {path}: the stream had no chunks")
    samples = 0
    if fmt.startswith("pcm_"):
        encoder = AudioEncoder(fmt)
        with open(path, "wb") as out:
            for chunk in _chain(first, items):
                out.write(encoder.encode(chunk))
                samples += chunk.pcm.numel()
        return samples
    import soundfile

    container, subtype = _SOUNDFILE.get(fmt, ("WAV", "PCM_16"))
    with soundfile.SoundFile(
        str(path), "w", first.sample_rate, 1, subtype=subtype, format=container
    ) as out:
        for chunk in _chain(first, items):
            if chunk.sample_rate != first.sample_rate:
                raise ValueError(
                    f"audio chunk at {chunk.sample_rate} Hz in a {first.sample_rate} Hz stream"
                )
            out.write(chunk.pcm.detach().reshape(-1).float().numpy())
            samples += chunk.pcm.numel()
    return samples


def _chain(first: AudioChunk, rest: Iterable[AudioChunk]) -> Iterable[AudioChunk]:
    yield first
    yield from rest
