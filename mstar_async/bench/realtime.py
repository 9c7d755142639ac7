"""Realtime sessions over ``/v1/realtime``: barge-in, server VAD's detection delay, time to first
audio against a turn-based baseline and after a spoken turn, and playback underruns, with N
sessions at once.

The served app (``create_app``, as ``mstar serve`` builds it, with its ``silero-vad``) runs on
uvicorn in this process and event loop; the clients are plain websocket (and HTTP/1.1) clients
on the same loop, talking to it over loopback. For each session count N, N sessions run this
script at once:

1. ``session.update``: instructions, the voice, replies bounded to ``reply_tokens``
   (``max_response_output_tokens``), server VAD that interrupts but does not answer
   (``create_response: false``);
2. a text turn: ``conversation.item.create`` and ``response.create`` (``max_output_tokens`` =
   ``reply_tokens``) sent back to back; time to first audio (TTFA) counts from the first send to
   the first ``response.output_audio.delta``; the reply's audio deltas, as they arrive, are
   played by a simulated player (``bench.speech.simulate_playback``): an underrun is a delta
   arriving after all audio before it finished playing;
3. barge-in, once every session's text turn has ended: a long reply starts
   (``barge_tokens``); at its first audio the session streams a spoken sentence (the shipped
   ``audio/stop.flac``, 24 kHz, between ``lead_s`` and ``tail_s`` of silence) in 20 ms pieces
   at real-time pace. The server's VAD reports ``speech_started`` (and cancels the reply) and
   later ``speech_stopped`` (and commits the turn);
4. a spoken turn, once every session's barge-in has ended: the input buffer cleared and every
   item deleted (the conversation starts afresh, as the text turn's did), server VAD now
   answers (``create_response: true``) and the session streams the same sentence; the server
   hears it as it comes (its audio encoder runs while the user talks) and at
   ``speech_stopped`` commits the turn and answers it within the session's
   ``max_response_output_tokens``. Spoken TTFA counts from ``speech_stopped``'s arrival to the
   answer's first audio delta.

Then the same N text turns go, at once, through the turn-based baseline: ``POST
/v1/chat/completions`` with ``modalities: ["text", "audio"]``, ``audio.format: pcm16``,
``stream: true`` and the same messages and token bound; its TTFA counts to the first chunk
carrying audio. Rounds alternate which goes first (a shared machine's load drifts).

With ``rounds`` above one, the N sessions run that many times in a row before the baseline, and
every figure below pools their sessions (``barge_ins`` counts them; KV free is the median over
rounds). Per session count: barge-in time (each session's ``speech_started`` arrival to its
``response.done``, and from a round's last ``speech_started`` to the model's KV blocks all free,
polled every millisecond); VAD delay in audio time (``audio_start_ms + prefix_padding_ms``
against the speech's onset in the sent audio; ``audio_end_ms - silence_duration_ms`` against its
real end) and in wall time (``speech_started`` arrival after the onset's piece was sent); TTFA
realtime and baseline; spoken TTFA, against the text turn's; what the encoder had left at VAD
stop: ``speech_stopped`` to ``input_audio_buffer.committed`` (the server finishes the hearing
before it commits) and the speech it had not yet convolved (the server's
``mstar_realtime_turn_unheard_seconds``, read in process); underruns, stall and audio delivered
per wall second of the reply.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import soundfile as sf
import torch
import uvicorn

from mstar_async.bench.common import free_port, machine_info, percentile, quiet
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.bench.speech import simulate_playback
from mstar_async.engines.kv.handles import KeptKV
from mstar_async.loop import run_async

Progress = Callable[[str], None]

SPEECH = Path(__file__).resolve().parent / "audio" / "stop.flac"
CLIENT_RATE = 24_000
PIECE_S = 0.02
MODEL = "qwen3-omni"
INSTRUCTIONS = "Answer in one short sentence."
TURN = "Tell me a story about a dragon."
#: Server VAD's settings in the sessions (the API's defaults, no automatic response but in the
#: spoken turn).
VAD = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "create_response": False,
    "interrupt_response": True,
}
_WAIT_S = 300.0
_BARGE_IN_AIM_MS = 100.0
_SPOKEN_AIM = 1.2
#: The server's histogram of speech not yet encoded when a realtime turn ended.
_UNHEARD = "mstar_realtime_turn_unheard_seconds"


class RealtimeBenchError(RuntimeError):
    """The server did not start, or a session saw something other than the script expects."""


@dataclass(frozen=True)
class RealtimeConfig:
    """What to measure: the served qwen3-omni's ``size``, the session counts, the text turn's
    token bound (``reply_tokens``) and the reply barged into (``barge_tokens``, long enough to
    be playing when the user speaks), torch ``threads``, the voice, and how many ``rounds`` of
    N sessions run per session count (their figures pooled: 5 rounds of 4 are 20 barge-ins).

    Raises:
        ValueError: an unknown size, or a count below 1.
    """

    size: str = "tiny"
    sessions: tuple[int, ...] = (1, 4, 8)
    reply_tokens: int = 8
    barge_tokens: int = 512
    threads: int = 1
    rounds: int = 1
    voice: str = "ethan"
    lead_s: float = 0.5
    tail_s: float = 1.0

    def __post_init__(self) -> None:
        if self.size not in ("tiny", "small"):
            raise ValueError(f"size must be tiny or small, got {self.size!r}")
        counts = (*self.sessions, self.reply_tokens, self.barge_tokens, self.threads, self.rounds)
        if not self.sessions or min(counts) < 1:
            raise ValueError(f"sessions, token bounds and threads must be >= 1: {self}")


def preset(quick: bool) -> RealtimeConfig:
    """The full workload (1, 4 and 8 sessions), or the quick one (1 and 2, 4-token replies)."""
    return RealtimeConfig(sessions=(1, 2), reply_tokens=4) if quick else RealtimeConfig()


def configure(base: RealtimeConfig, **changes: Any) -> RealtimeConfig:
    """``base`` with the changes that are not ``None``.

    Raises:
        ValueError: as ``RealtimeConfig``.
    """
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


# --- the user's speech ----------------------------------------------------------------------


@dataclass(frozen=True)
class Speech:
    """The audio a session sends (pcm16 at 24 kHz) and where its speech truly is (seconds)."""

    pcm: bytes
    onset_s: float
    end_s: float

    @property
    def pieces(self) -> list[bytes]:
        """The audio in 20 ms pieces, as a microphone delivers it."""
        step = int(CLIENT_RATE * PIECE_S) * 2
        return [self.pcm[i : i + step] for i in range(0, len(self.pcm), step)]


def speech_bounds(audio: np.ndarray, rate: int, floor_db: float = -35.0) -> tuple[float, float]:
    """Where speech starts and ends in ``audio``: the first and last 10 ms frame whose RMS is
    within ``floor_db`` of the loudest frame's.

    Raises:
        ValueError: the audio is silent.
    """
    size = rate // 100
    frames = audio[: len(audio) // size * size].reshape(-1, size)
    rms = np.sqrt((frames.astype(np.float64) ** 2).mean(axis=1))
    if rms.size == 0 or rms.max() <= 0:
        raise ValueError("the audio is silent")
    loud = np.flatnonzero(rms >= rms.max() * 10 ** (floor_db / 20))
    return float(loud[0] * size / rate), float((loud[-1] + 1) * size / rate)


def load_speech(config: RealtimeConfig, path: Path = SPEECH) -> Speech:
    """The shipped sentence between the configured silences.

    Raises:
        OSError: the file cannot be read. ValueError: it is not 24 kHz speech.
    """
    audio, rate = sf.read(str(path), dtype="float32")
    if rate != CLIENT_RATE:
        raise ValueError(f"{path} is {rate} Hz; the sessions send {CLIENT_RATE} Hz")
    onset, end = speech_bounds(audio, rate)
    silence = [np.zeros(int(s * rate), np.float32) for s in (config.lead_s, config.tail_s)]
    whole = np.concatenate([silence[0], audio, silence[1]])
    pcm = (np.clip(whole, -1, 1) * 32767).astype("<i2").tobytes()
    return Speech(pcm, config.lead_s + onset, config.lead_s + end)


# --- one realtime session -------------------------------------------------------------------


@dataclass
class SessionFigures:
    """One session's measurements (seconds unless named otherwise)."""

    ttfa_s: float = 0.0
    audio_s: float = 0.0
    stream_s: float = 0.0  # first audio delta to response.done
    underruns: int = 0
    stall_s: float = 0.0
    barge_in_done_s: float = 0.0  # speech_started arrival to response.done arrival
    barge_in_status: str = ""
    vad_start_lag_ms: float = 0.0  # audio time
    vad_start_wall_s: float = 0.0
    vad_stop_lag_ms: float = 0.0  # audio time, silence_duration_ms taken off
    spoken_ttfa_s: float = 0.0  # speech_stopped arrival to the answer's first audio delta
    spoken_commit_s: float = 0.0  # speech_stopped arrival to input_audio_buffer.committed


@dataclass
class _Events:
    """A session's socket: events in arrival order, each with its ``perf_counter`` time."""

    ws: Any
    seen: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, *kinds: str) -> tuple[float, dict[str, Any]]:
        """Read events up to the first of one of ``kinds``; its arrival time and itself.

        Raises:
            RealtimeBenchError: an ``error`` event, or a failed response, came first.
        """
        while True:
            event = json.loads(await self.ws.recv())
            arrived = time.perf_counter()
            self.seen.append((arrived, event))
            if event["type"] == "error" or (
                event["type"] == "response.done" and event["response"]["status"] == "failed"
            ):
                raise RealtimeBenchError(f"the session got {event}")
            if event["type"] in kinds:
                return arrived, event


async def _configure(events: _Events, config: RealtimeConfig, *, answer: bool) -> None:
    """``session.update``: the bench's session, server VAD answering turns or not."""
    session = {
        "type": "realtime",
        "instructions": INSTRUCTIONS,
        "max_response_output_tokens": config.reply_tokens,
        "audio": {
            "input": {"turn_detection": {**VAD, "create_response": answer}},
            "output": {"voice": config.voice},
        },
    }
    await events.send({"type": "session.update", "session": session})
    await events.until("session.updated")


async def _speak(events: _Events, speech: Speech, sent: list[float]) -> None:
    """Stream ``speech`` in 20 ms pieces at real-time pace; each piece's send time in ``sent``."""
    begin = time.perf_counter()
    for k, piece in enumerate(speech.pieces):
        await anyio.sleep(max(0.0, begin + k * PIECE_S - time.perf_counter()))
        sent.append(time.perf_counter())
        audio = base64.b64encode(piece).decode("ascii")
        await events.send({"type": "input_audio_buffer.append", "audio": audio})


async def _text_turn(events: _Events, config: RealtimeConfig, figures: SessionFigures) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TURN}]}
    started = time.perf_counter()
    await events.send({"type": "conversation.item.create", "item": item})
    await events.send(
        {"type": "response.create", "response": {"max_output_tokens": config.reply_tokens}}
    )
    mark = len(events.seen)
    done_at, _ = await events.until("response.done")
    chunks = [
        (t - started, len(base64.b64decode(e["delta"])) / 2 / CLIENT_RATE)
        for t, e in events.seen[mark:]
        if e["type"] == "response.output_audio.delta"
    ]
    if not chunks:
        raise RealtimeBenchError("the text turn's reply had no audio: raise reply_tokens")
    played = simulate_playback(chunks)
    figures.ttfa_s = chunks[0][0]
    figures.audio_s = sum(seconds for _, seconds in chunks)
    figures.stream_s = done_at - started - chunks[0][0]
    figures.underruns, figures.stall_s = played.underruns, played.stall_s


async def _spoken_turn(
    events: _Events, config: RealtimeConfig, speech: Speech, figures: SessionFigures
) -> None:
    # A fresh conversation, as the text turn had: the same prompt but for the user's turn.
    await events.send({"type": "input_audio_buffer.clear"})
    await events.until("input_audio_buffer.cleared")
    for item_id in dict.fromkeys(
        e["item"]["id"] for _, e in events.seen if e["type"] == "conversation.item.added"
    ):
        await events.send({"type": "conversation.item.delete", "item_id": item_id})
        await events.until("conversation.item.deleted")
    await _configure(events, config, answer=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_speak, events, speech, [])
        stopped_at, _ = await events.until("input_audio_buffer.speech_stopped")
        committed_at, _ = await events.until("input_audio_buffer.committed")
        first_at, first = await events.until("response.output_audio.delta", "response.done")
        if first["type"] == "response.done":
            raise RealtimeBenchError("the spoken turn's reply had no audio: raise reply_tokens")
        await events.until("response.done")
    figures.spoken_ttfa_s = first_at - stopped_at
    figures.spoken_commit_s = committed_at - stopped_at


class Step:
    """Sessions arriving at one step of the script: ``all`` is set when every one has."""

    def __init__(self, sessions: int) -> None:
        self.sessions = sessions
        self.count = 0
        self.all = anyio.Event()

    def arrive(self) -> None:
        """One more session reached the step."""
        self.count += 1
        if self.count == self.sessions:
            self.all.set()

    async def reached(self) -> None:
        """One more session reached the step; wait for the others."""
        self.arrive()
        await self.all.wait()


class RoundSteps:
    """A round's sessions in step: ``texts`` (every session's text turn has ended), ``barges``
    (every barge-in has, its turn committed) and ``spoken`` (every spoken turn has), so that no
    session's long reply loads the model while another's turn is being timed;
    ``all_started`` at the last ``speech_started``, whose arrival ``last`` holds."""

    def __init__(self, sessions: int) -> None:
        self.last = 0.0
        self.texts = Step(sessions)
        self.barges = Step(sessions)
        self.spoken = Step(sessions)
        self._started = Step(sessions)
        self.all_started = self._started.all

    def started(self, at: float) -> None:
        """One more session's ``speech_started`` arrived at ``at`` (``perf_counter``)."""
        self.last = max(self.last, at)
        self._started.arrive()


async def _barge_in(
    events: _Events,
    config: RealtimeConfig,
    speech: Speech,
    figures: SessionFigures,
    steps: RoundSteps | None,
) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TURN}]}
    await events.send({"type": "conversation.item.create", "item": item})
    await events.send(
        {"type": "response.create", "response": {"max_output_tokens": config.barge_tokens}}
    )
    await events.until("response.output_audio.delta")
    sent: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_speak, events, speech, sent)
        started_at, started = await events.until("input_audio_buffer.speech_started")
        if steps is not None:
            steps.started(started_at)
        done_at, done = await events.until("response.done")
        _, stopped = await events.until("input_audio_buffer.speech_stopped")
        await events.until("conversation.item.added")  # the turn, committed (and heard)
    onset_piece = min(int(speech.onset_s / PIECE_S), len(sent) - 1)
    figures.barge_in_done_s = done_at - started_at
    details = done["response"]["status_details"] or {}
    figures.barge_in_status = f"{done['response']['status']}: {details.get('reason')}"
    figures.vad_start_lag_ms = (
        started["audio_start_ms"] + VAD["prefix_padding_ms"] - 1000 * speech.onset_s
    )
    figures.vad_start_wall_s = started_at - sent[onset_piece]
    figures.vad_stop_lag_ms = (
        stopped["audio_end_ms"] - VAD["silence_duration_ms"] - 1000 * speech.end_s
    )
    if done["response"]["status"] != "cancelled":
        raise RealtimeBenchError(f"the reply was not cut by the user's speech: {done}")


async def run_session(
    url: str, config: RealtimeConfig, speech: Speech, steps: RoundSteps | None = None
) -> SessionFigures:
    """One session's script (the module docstring): its figures; its steps are noted in
    ``steps``. Cancel-safe: cancelling closes the socket (the server then ends the session
    and its response).

    Raises:
        RealtimeBenchError: the session saw an error, a reply had no audio, or the reply was
            not barged into.
        OSError: the server cannot be reached.
    """
    import websockets

    figures = SessionFigures()
    uri = url.replace("http", "ws", 1) + f"/v1/realtime?model={MODEL}"
    async with websockets.connect(uri, max_size=None) as ws:
        events = _Events(ws)
        await events.until("session.created")
        await _configure(events, config, answer=False)
        await _text_turn(events, config, figures)
        if steps is not None:
            await steps.texts.reached()
        await _barge_in(events, config, speech, figures, steps)
        if steps is not None:
            await steps.barges.reached()
        await _spoken_turn(events, config, speech, figures)
        if steps is not None:
            steps.spoken.arrive()
    return figures


# --- the turn-based baseline ----------------------------------------------------------------


async def chat_ttfa(url: str, config: RealtimeConfig) -> float:
    """Seconds from sending a streamed spoken chat completion (the text turn's messages) to
    its first chunk carrying audio; the rest of the reply is read and dropped. Cancel-safe:
    the connection is closed (the server then cancels the request).

    Raises:
        RealtimeBenchError: an HTTP error, or a reply without audio.
    """
    import h11

    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": TURN},
            ],
            "modalities": ["text", "audio"],
            "audio": {"voice": config.voice, "format": "pcm16"},
            "stream": True,
            "max_tokens": config.reply_tokens,
        }
    ).encode()
    connection = h11.Connection(h11.CLIENT)
    headers = [
        ("host", f"{host}:{port}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    first: float | None = None
    buffer = b""
    started = time.perf_counter()
    async with await anyio.connect_tcp(host, int(port)) as stream:
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
        await stream.send(connection.send(request) + connection.send(h11.Data(data=body)))
        await stream.send(connection.send(h11.EndOfMessage()))
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive(65536))
                continue
            if isinstance(event, h11.Response) and event.status_code != 200:
                raise RealtimeBenchError(f"the chat baseline answered {event.status_code}")
            if isinstance(event, h11.Data):
                buffer += bytes(event.data)
                lines, _, buffer = buffer.rpartition(b"\n")
                if first is None and b'"data"' in lines and b'"audio"' in lines:
                    first = time.perf_counter() - started
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    if first is None:
        raise RealtimeBenchError("the chat baseline's reply had no audio: raise reply_tokens")
    return first


# --- rounds ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probes:
    """What the bench reads from the server in its process: the model's KV blocks in use beyond
    those the sessions keep between turns, and the committed turns it has heard (how many, and
    the seconds of their speech its encoder had not convolved when each ended, summed)."""

    kv_blocks: Callable[[], int]
    heard: Callable[[], tuple[float, float]]


def _probes(app: Any) -> Probes:
    runtime = app.state.server.models[MODEL].runtime
    registry = app.state.server.metrics.registry

    def heard() -> tuple[float, float]:
        def value(suffix: str) -> float:
            found = registry.get_sample_value(f"{_UNHEARD}_{suffix}", {"model": MODEL})
            return float(found or 0.0)

        return value("count"), value("sum")

    def reply_blocks() -> int:
        # A session keeps its conversation's KV between turns (handles): what a cancelled
        # reply frees is what the engines hold beyond that.
        engines = runtime.batching.engines.values()
        kept = sum(e.kept_blocks for e in engines if isinstance(e, KeptKV))
        return int(runtime.batching.kv_blocks_in_use) - kept

    return Probes(reply_blocks, heard)


async def _unheard_ms(heard: Callable[[], tuple[float, float]], steps: RoundSteps) -> float | None:
    """The mean speech (ms) of the round's spoken turns that the encoder had not convolved at
    their end (None if the server heard none of them)."""
    await steps.barges.all.wait()
    count, total = heard()
    await steps.spoken.all.wait()
    after_count, after_total = heard()
    turns = after_count - count
    return round(1000 * (after_total - total) / turns, 1) if turns else None


async def _kv_free_after(kv_blocks: Callable[[], int], steps: RoundSteps) -> float:
    """Seconds from the round's last ``speech_started`` until ``kv_blocks()`` (the blocks no
    session keeps) is 0, polled every millisecond (every session's reply was cancelled by
    then)."""
    await steps.all_started.wait()
    while kv_blocks():  # noqa: ASYNC110 (the engines' count: there is no event to wait on)
        await anyio.sleep(0.001)
    return time.perf_counter() - steps.last


def _spread(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> dict[str, float]:
    return {
        "p50": round(scale * percentile(values, 50), digits),
        "p95": round(scale * percentile(values, 95), digits),
        "max": round(scale * max(values), digits),
    }


async def _sessions_round(
    url: str,
    config: RealtimeConfig,
    speech: Speech,
    probes: Probes,
    n: int,
    sessions: list[SessionFigures],
    kv_free_s: list[float],
    unheard_ms: list[float],
) -> None:
    """N sessions at once, in step; their figures, the round's KV-free time and what the
    encoder had left at VAD stop are appended to the lists."""
    steps = RoundSteps(n)

    async def one() -> None:
        sessions.append(await run_session(url, config, speech, steps))

    async def watch_kv() -> None:
        kv_free_s.append(await _kv_free_after(probes.kv_blocks, steps))

    async def watch_heard() -> None:
        unheard = await _unheard_ms(probes.heard, steps)
        if unheard is not None:
            unheard_ms.append(unheard)

    with anyio.fail_after(_WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_kv)
            tg.start_soon(watch_heard)
            for _ in range(n):
                tg.start_soon(one)


async def _round(
    url: str,
    config: RealtimeConfig,
    speech: Speech,
    probes: Probes,
    n: int,
    chat_first: bool,
) -> dict[str, Any]:
    sessions: list[SessionFigures] = []
    chat: list[float] = []
    kv_free_s: list[float] = []
    unheard_ms: list[float] = []

    async def realtime_phase() -> None:
        for _ in range(config.rounds):
            await _sessions_round(url, config, speech, probes, n, sessions, kv_free_s, unheard_ms)

    async def chat_phase() -> None:
        async def one() -> None:
            chat.append(await chat_ttfa(url, config))

        with anyio.fail_after(_WAIT_S):
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)

    for phase in (chat_phase, realtime_phase) if chat_first else (realtime_phase, chat_phase):
        await phase()
    ttfa = [s.ttfa_s for s in sessions]
    spoken = [s.spoken_ttfa_s for s in sessions]
    delivered = [s.audio_s / s.stream_s for s in sessions if s.stream_s > 0]
    return {
        "sessions": n,
        "barge_in_to_response_done_ms": _spread([s.barge_in_done_s for s in sessions], 1000),
        "rounds": config.rounds,
        "barge_ins": len(sessions),
        "barge_in_last_speech_started_to_kv_free_ms": round(1000 * percentile(kv_free_s, 50), 1),
        "barge_in_statuses": sorted({s.barge_in_status for s in sessions}),
        "vad_start_lag_audio_ms": _spread([s.vad_start_lag_ms for s in sessions]),
        "vad_start_lag_wall_ms": _spread([s.vad_start_wall_s for s in sessions], 1000),
        "vad_stop_lag_audio_ms": _spread([s.vad_stop_lag_ms for s in sessions]),
        "ttfa_realtime_ms": _spread(ttfa, 1000),
        "ttfa_chat_ms": _spread(chat, 1000),
        "ttfa_realtime_over_chat_p50": round(percentile(ttfa, 50) / percentile(chat, 50), 3),
        "spoken_ttfa_ms": _spread(spoken, 1000),
        "spoken_over_text_ttfa_p50": round(percentile(spoken, 50) / percentile(ttfa, 50), 3),
        "spoken_stop_to_committed_ms": _spread([s.spoken_commit_s for s in sessions], 1000),
        "spoken_unheard_at_stop_ms_mean": (
            round(sum(unheard_ms) / len(unheard_ms), 1) if unheard_ms else None
        ),
        "reply_audio_s_p50": round(percentile([s.audio_s for s in sessions], 50), 3),
        "audio_s_per_wall_s_p50": round(percentile(delivered, 50), 2) if delivered else None,
        "underruns": sum(s.underruns for s in sessions),
        "stall_s_total": round(sum(s.stall_s for s in sessions), 3),
        "order": "chat first" if chat_first else "realtime first",
    }


async def run_realtime(config: RealtimeConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Serve qwen3-omni (and silero-vad) on uvicorn in this loop; measure ``config``; the
    report as a JSON-ready dict. Cancel-safe: the server stops when the measurement ends.

    Raises:
        RealtimeBenchError: the server did not start, or a session misbehaved.
        OSError, ValueError: the speech file cannot be read.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return await _serve_and_measure(config, progress)
    finally:
        torch.set_num_threads(threads)


async def _serve_and_measure(config: RealtimeConfig, progress: Progress) -> dict[str, Any]:
    from mstar_async.models import build_model
    from mstar_async.server import ModelSpec, create_app

    machine = machine_info()
    started = time.perf_counter()
    speech = load_speech(config)
    progress(f"opening {MODEL} ({config.size}) and silero-vad on uvicorn in this process")
    app = create_app([ModelSpec(build_model(MODEL, size=config.size))], max_concurrent=256)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, lifespan="on", access_log=False, log_level="warning"
        )
    )
    serving = asyncio.ensure_future(server.serve())
    url = f"http://127.0.0.1:{port}"
    results: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(_WAIT_S):
            while not server.started:
                if serving.done():
                    raise RealtimeBenchError("the server did not start (see the log above)")
                await anyio.sleep(0.05)
        probes = _probes(app)
        await run_session(url, replace(config, reply_tokens=2), speech)  # warm every path
        await chat_ttfa(url, config)
        for i, n in enumerate(config.sessions):
            result = await _round(url, config, speech, probes, n, chat_first=i % 2 == 1)
            results.append(result)
            progress(_progress_line(result))
    finally:
        server.should_exit = True
        await serving
    machine["load_average_end"] = machine_info()["load_average"]
    return make_report(
        "realtime",
        workload={
            **asdict(config),
            "sessions": list(config.sessions),
            "model": MODEL,
            "speech": "audio/stop.flac (espeak-ng, 24 kHz)",
            "speech_onset_s": round(speech.onset_s, 3),
            "speech_end_s": round(speech.end_s, 3),
            "turn_detection": VAD,
        },
        machine=machine,
        systems=[
            system_entry(
                "realtime",
                "/v1/realtime: conversation.item.create + response.create, a spoken turn "
                "answered by server VAD, barge-in",
            ),
            system_entry(
                "chat",
                "POST /v1/chat/completions, modalities text+audio, pcm16, streamed (turn-based)",
            ),
        ],
        results=results,
        aims=_aims(results),
        seconds=time.perf_counter() - started,
    )


def _progress_line(result: dict[str, Any]) -> str:
    return (
        f"N={result['sessions']}: barge-in -> response.done p50 "
        f"{result['barge_in_to_response_done_ms']['p50']} ms, -> KV free "
        f"{result['barge_in_last_speech_started_to_kv_free_ms']} ms; VAD start lag "
        f"{result['vad_start_lag_audio_ms']['p50']} ms audio / "
        f"{result['vad_start_lag_wall_ms']['p50']} ms wall; TTFA realtime "
        f"{result['ttfa_realtime_ms']['p50']} ms vs chat {result['ttfa_chat_ms']['p50']} ms; "
        f"spoken TTFA {result['spoken_ttfa_ms']['p50']} ms "
        f"({result['spoken_over_text_ttfa_p50']}x text), speech_stopped -> committed "
        f"{result['spoken_stop_to_committed_ms']['p50']} ms, unheard at stop "
        f"{result['spoken_unheard_at_stop_ms_mean']} ms; "
        f"{result['underruns']} underruns"
    )


def _aims(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    one = next((r for r in results if r["sessions"] == 1), None)
    return [
        aim_entry(
            "barge-in: last speech_started to KV free, 1 session (ms)",
            _BARGE_IN_AIM_MS,
            None if one is None else one["barge_in_last_speech_started_to_kv_free_ms"],
            compare="<=",
        ),
        aim_entry(
            "TTFA realtime / chat completions, p50, 1 session",
            1.25,
            None if one is None else one["ttfa_realtime_over_chat_p50"],
            compare="<=",
        ),
        aim_entry(
            "spoken TTFA (speech_stopped to first audio) / text-turn TTFA, p50, 1 session",
            _SPOKEN_AIM,
            None if one is None else one["spoken_over_text_ttfa_p50"],
            compare="<=",
        ),
    ]


def run_realtime_sync(config: RealtimeConfig, progress: Progress = quiet) -> dict[str, Any]:
    """``run_realtime`` on a fresh event loop (uvloop where installed)."""
    report: dict[str, Any] = run_async(run_realtime, config, progress)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as one table row per session count, then the aims."""
    work, machine = report["workload"], report["machine"]
    lines = [
        f"realtime benchmark: {work['model']} {work['size']}, replies of {work['reply_tokens']} "
        f"tokens, {work['threads']} torch thread(s), {report['seconds']:.0f} s",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, load average "
        f"{machine['load_average']} -> {machine.get('load_average_end')}",
        "",
    ]
    header = (
        f"{'N':>3} | {'barge->done p50/max':>19} | {'->KV free':>9} | {'VAD start audio/wall':>20}"
        f" | {'VAD stop':>8} | {'TTFA rt p50':>11} | {'TTFA chat p50':>13} | {'rt/chat':>7} | "
        f"{'spoken p50':>10} | {'spoken/rt':>9} | {'stop->commit':>12} | {'underruns':>9}"
    )
    lines += [header, "-" * len(header)]
    for r in report["results"]:
        barge, start = r["barge_in_to_response_done_ms"], r["vad_start_lag_audio_ms"]
        lines.append(
            f"{r['sessions']:>3} | {barge['p50']:>8.1f} / {barge['max']:>8.1f} | "
            f"{r['barge_in_last_speech_started_to_kv_free_ms']:>9.1f} | "
            f"{start['p50']:>8.1f} / {r['vad_start_lag_wall_ms']['p50']:>9.1f} | "
            f"{r['vad_stop_lag_audio_ms']['p50']:>8.1f} | {r['ttfa_realtime_ms']['p50']:>11.1f} | "
            f"{r['ttfa_chat_ms']['p50']:>13.1f} | {r['ttfa_realtime_over_chat_p50']:>7.3f} | "
            f"{r['spoken_ttfa_ms']['p50']:>10.1f} | {r['spoken_over_text_ttfa_p50']:>9.3f} | "
            f"{r['spoken_stop_to_committed_ms']['p50']:>12.1f} | {r['underruns']:>9}"
        )
    lines.append(
        "(ms; VAD lags in audio time against the speech's true onset and end; spoken TTFA from "
        "speech_stopped's arrival, stop->commit the encoder's last work and the commit)"
    )
    for aim in report["aims"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[aim["met"]]
        lines.append(
            f"aim {aim['name']}: {aim['measured']} {aim['compare']} {aim['target']}: {verdict}"
        )
    return "\n".join(lines)
