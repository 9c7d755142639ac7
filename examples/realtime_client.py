"""Talk to ``/v1/realtime`` with the ``openai`` package's realtime client: a spoken turn from a
WAV file (or a typed one with ``--text``), the reply's speech written to a WAV file and its
transcript printed.

Start a server that speaks (``mstar serve qwen3-omni``), then

    python examples/realtime_client.py --wav question.wav --out reply.wav
    python examples/realtime_client.py --text "Tell me a story" --out reply.wav

With ``--wav`` the file (any rate, any channel count: it is mixed down and resampled to the
API's 24 kHz pcm16) goes out in 20 ms pieces at the pace a microphone would deliver them
(``--fast``: as fast as the socket takes them), followed by a second of silence; the server's
VAD finds where the turn starts and ends, commits it and starts the reply. ``--commit`` turns
server VAD off and commits the buffer by hand after the last piece instead.

qwen3-omni hears the turn while it is spoken (the server streams it into the model's audio
encoder) and answers it with speech. A refusal or a failed reply is printed (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import time
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
from openai import AsyncOpenAI

RATE = 24_000  # the Realtime API's pcm16 rate, both ways
PIECE = RATE // 50  # 20 ms


def read_pcm16(path: Path) -> bytes:
    """The file's audio as mono pcm16 at 24 kHz."""
    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if rate != RATE:
        mono = soxr.resample(mono, rate, RATE)
    return (np.clip(mono, -1, 1) * 32767).astype("<i2").tobytes()


async def send_speech(connection: Any, pcm: bytes, *, paced: bool) -> None:
    """``pcm`` in 20 ms appends, each at its time when ``paced``."""
    start = time.perf_counter()
    for k, offset in enumerate(range(0, len(pcm), 2 * PIECE)):
        if paced:
            await asyncio.sleep(max(0.0, start + k * PIECE / RATE - time.perf_counter()))
        piece = base64.b64encode(pcm[offset : offset + 2 * PIECE]).decode("ascii")
        await connection.input_audio_buffer.append(audio=piece)


async def converse(args: argparse.Namespace) -> tuple[bytes, str]:
    """Run one turn; the reply's pcm16 and its transcript.

    Raises:
        RuntimeError: the server refused something or the reply failed (says what).
    """
    client = AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0)
    spoken = args.text is None
    detection = None if args.commit or not spoken else {"type": "server_vad"}
    async with client.realtime.connect(model=args.model) as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "instructions": args.instructions,
                "output_modalities": ["audio"],
                "max_output_tokens": args.max_tokens,
                "audio": {
                    "input": {"turn_detection": detection},
                    "output": {"voice": args.voice},
                },
            }
        )
        if spoken:
            pcm = read_pcm16(args.wav)
            if not args.commit:
                pcm += b"\x00\x00" * RATE  # a second of silence: the VAD hears the turn end
            await send_speech(connection, pcm, paced=not args.fast)
            if args.commit:
                await connection.input_audio_buffer.commit()
                await connection.response.create()
        else:
            text = {"type": "input_text", "text": args.text}
            await connection.conversation.item.create(
                item={"type": "message", "role": "user", "content": [text]}
            )
            await connection.response.create()
        audio, transcript = bytearray(), []
        async for event in connection:
            if event.type == "error":
                refused = event.error
                raise RuntimeError(f"the server refused: {refused.code}: {refused.message}")
            if event.type == "input_audio_buffer.speech_started":
                print(f"speech started at {event.audio_start_ms} ms", file=sys.stderr)
            elif event.type == "input_audio_buffer.speech_stopped":
                print(f"speech stopped at {event.audio_end_ms} ms", file=sys.stderr)
            elif event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)
            elif event.type == "response.output_audio_transcript.delta":
                transcript.append(event.delta)
            elif event.type == "response.done":
                response = event.response
                if response.status != "completed":
                    details = response.status_details
                    error = getattr(details, "error", None)
                    why = getattr(error, "code", None) or getattr(details, "reason", None)
                    raise RuntimeError(f"the reply {response.status}: {why}")
                return bytes(audio), "".join(transcript)
    raise RuntimeError("the server closed the session before the reply ended")


def write_wav(path: Path, pcm: bytes) -> None:
    """``pcm`` (mono pcm16 at 24 kHz) as a WAV file."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(pcm)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn = parser.add_mutually_exclusive_group(required=True)
    turn.add_argument("--wav", type=Path, help="the user's spoken turn")
    turn.add_argument("--text", help="a typed turn instead")
    parser.add_argument("--out", type=Path, default=Path("reply.wav"), help="the reply's speech")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--model", default="qwen3-omni")
    parser.add_argument("--voice", default="ethan")
    parser.add_argument("--max-tokens", type=int, default=64, help="the reply's token bound")
    parser.add_argument("--instructions", default="Answer in one or two short sentences.")
    parser.add_argument("--api-key", default=os.environ.get("MSTAR_API_KEY", "unused"))
    parser.add_argument("--commit", action="store_true", help="no server VAD: commit by hand")
    parser.add_argument("--fast", action="store_true", help="send the audio unpaced")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; 0 when the reply was written, 1 when the server refused or failed."""
    args = parse(argv)
    try:
        pcm, transcript = asyncio.run(converse(args))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    write_wav(args.out, pcm)
    print(transcript)
    print(f"{len(pcm) / 2 / RATE:.2f} s of speech written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
