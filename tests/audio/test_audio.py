"""mstar_async.audio: PCM, WAV, FLAC and Ogg out of a stream of AudioChunks."""

from __future__ import annotations

import io
import math
import struct
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import soundfile
import torch

from mstar_async.audio import FORMATS, AudioEncoder, encode_stream, format_for_path, write_audio
from mstar_async.outputs import AudioChunk

RATE = 24_000
S16 = 1 / 32767


def tone(seconds: float = 0.5) -> torch.Tensor:
    t = torch.arange(int(RATE * seconds)) / RATE
    return 0.6 * torch.sin(2 * math.pi * 440 * t) * torch.linspace(0, 1, t.numel())


def chunks(pcm: torch.Tensor, size: int = 2048) -> list[AudioChunk]:
    return [AudioChunk(piece, RATE) for piece in pcm.split(size)]


def encode_all(fmt: str, pieces: list[AudioChunk]) -> bytes:
    encoder = AudioEncoder(fmt)
    return b"".join(encoder.encode(c) for c in pieces) + encoder.finish()


def test_raw_pcm_is_little_endian_samples() -> None:
    pcm = torch.tensor([0.0, 0.5, -1.0, 2.0])
    assert encode_all("pcm_s16le", chunks(pcm, 3)) == struct.pack("<4h", 0, 16384, -32767, 32767)
    assert encode_all("pcm_f32le", chunks(pcm, 3)) == struct.pack("<4f", 0.0, 0.5, -1.0, 2.0)


def test_streamed_wav_reads_back_with_wave_and_soundfile() -> None:
    pcm = tone()
    data = encode_all("wav", chunks(pcm))
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert samples.size == pcm.numel()
    np.testing.assert_allclose(samples / 32767, pcm.numpy(), atol=S16)
    decoded, rate = soundfile.read(io.BytesIO(data))
    assert rate == RATE
    np.testing.assert_allclose(decoded, pcm.numpy(), atol=2 * S16)


def test_a_stream_without_audio_finishes_as_a_whole_empty_file_at_a_given_rate() -> None:
    assert AudioEncoder("wav").finish() == b""  # no rate: nothing to declare
    wav = AudioEncoder("wav").finish(RATE)
    with wave.open(io.BytesIO(wav)) as w:
        assert (len(wav), w.getframerate(), w.getnframes()) == (44, RATE, 0)
    flac = AudioEncoder("flac").finish(RATE)
    with soundfile.SoundFile(io.BytesIO(flac)) as f:  # header only: length unknown, as streamed
        assert (f.format, f.samplerate, f.channels, len(flac)) == ("FLAC", RATE, 1, 42)
    assert AudioEncoder("opus").finish(RATE)[:4] == b"OggS"
    assert AudioEncoder("pcm_s16le").finish(RATE) == AudioEncoder("mp3").finish(RATE) == b""
    encoder = AudioEncoder("wav")
    head = encoder.encode(AudioChunk(torch.zeros(2), RATE))
    assert len(head) == 48 and encoder.finish(RATE) == b""  # a stream with audio ends as before


def test_wav_file_has_exact_sizes(tmp_path: Path) -> None:
    pcm = tone()
    assert write_audio(tmp_path / "a.wav", chunks(pcm)) == pcm.numel()
    with wave.open(str(tmp_path / "a.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (RATE, 1, pcm.numel())
    assert (tmp_path / "a.wav").stat().st_size == 44 + 2 * pcm.numel()


def test_flac_file_and_stream_decode_within_16_bit_tolerance(tmp_path: Path) -> None:
    pcm = tone()
    write_audio(tmp_path / "a.flac", chunks(pcm))
    decoded, rate = soundfile.read(tmp_path / "a.flac")
    assert rate == RATE
    np.testing.assert_allclose(decoded, pcm.numpy(), atol=2 * S16)
    data = encode_all("flac", chunks(pcm))
    assert data[:4] == b"fLaC"
    # The stream's header says "length unknown" (0); libsndfile's reader wants the length, so
    # the test puts it in before decoding.
    (word,) = struct.unpack(">Q", data[18:26])
    assert word & ((1 << 36) - 1) == 0
    known = data[:18] + struct.pack(">Q", word | pcm.numel()) + data[26:]
    decoded, _ = soundfile.read(io.BytesIO(known))
    np.testing.assert_allclose(decoded, pcm.numpy(), atol=2 * S16)


def test_ogg_vorbis_keeps_length_and_rate(tmp_path: Path) -> None:
    pcm = tone()
    write_audio(tmp_path / "a.ogg", chunks(pcm))
    decoded, rate = soundfile.read(tmp_path / "a.ogg")
    assert rate == RATE and decoded.size == pcm.numel()
    assert np.corrcoef(decoded, pcm.numpy())[0, 1] > 0.95


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_streamed_mp3_and_opus_decode_to_the_whole_tone(fmt: str, tmp_path: Path) -> None:
    pcm = tone(1.0)
    pieces = chunks(pcm)
    encoder = AudioEncoder(fmt)
    streamed = [encoder.encode(c) for c in pieces] + [encoder.finish()]
    decoded, rate = soundfile.read(io.BytesIO(b"".join(streamed)))
    assert rate == RATE
    # Lossy codecs pad with their encoder delay; the decoded tone still covers the input.
    assert pcm.numel() <= decoded.size <= pcm.numel() + 4096
    if fmt == "mp3":  # bytes flow as the chunks arrive, not only at the end
        assert sum(map(len, streamed[: len(pieces) // 2])) > len(b"".join(streamed)) // 4
    write_audio(tmp_path / f"a.{fmt}", pieces)
    from_file, _ = soundfile.read(tmp_path / f"a.{fmt}")
    assert abs(from_file.size - pcm.numel()) <= 4096


@pytest.mark.anyio
async def test_encode_stream_yields_bytes_as_chunks_arrive() -> None:
    pieces = chunks(tone(0.2))

    async def source() -> AsyncIterator[AudioChunk]:
        for piece in pieces:
            await anyio.lowlevel.checkpoint()
            yield piece

    parts = [p async for p in encode_stream(source(), "wav")]
    assert len(parts) == len(pieces)
    assert b"".join(parts) == encode_all("wav", pieces)


def test_bad_formats_and_rates_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown audio format 'aac'; valid formats: pcm_s16le"):
        AudioEncoder("aac")
    with pytest.raises(ValueError, match=r"use one of \.wav, \.flac"):
        format_for_path("out.aac")
    encoder = AudioEncoder("wav")
    encoder.encode(AudioChunk(torch.zeros(4), RATE))
    with pytest.raises(ValueError, match="at 16000 Hz in a 24000 Hz stream"):
        encoder.encode(AudioChunk(torch.zeros(4), 16_000))
    with pytest.raises(ValueError, match="no audio to write"):
        write_audio(tmp_path / "a.wav", [])
    assert set(FORMATS) == {"pcm_s16le", "pcm_f32le", "wav", "flac", "ogg", "mp3", "opus"}
