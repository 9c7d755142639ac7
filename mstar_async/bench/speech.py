"""Streaming speech: time to first audio, real-time factor, throughput and playback underruns of
``orpheus`` through the runtime, against three baselines measured in the same run.

Workload: the sentences of ``mstar_async/bench/prompts/speech_en.txt`` (everyday sentences of varied
length), request ``i`` speaking line ``i`` with seed ``seed + i``, voice ``tara``, temperature 0.6,
top-p 0.8 and the same ``max_tokens`` everywhere. The seeded ``small`` LM nearly always runs to
``max_tokens`` (it rarely samples ``<end_of_speech>``), so ``max_tokens`` sets each utterance's
length: 211 tokens are 30 SNAC frames, 2.56 s of audio. For each concurrency N the N requests go,
all at once, to:

- ``streaming``: the runtime (one process): the LM's decode steps batch across requests and
  every frame's 7 codes stream to SNAC, with one frame before and two after as context, while
  the LM keeps going.
- ``streaming_split``: the same, with the LM and SNAC on worker processes of their own (a
  placement; the conductor stays in this process): as many compute processes as the pipeline.
  With ``ray`` (a cluster's address), those two ranks are Ray actors on two different nodes of
  that cluster (placement strategy STRICT_SPREAD), talking ZeroMQ TCP with CURVE keys made for
  the run: the codec on another node than the LM.
- ``non_streaming`` (baseline a): the same weights in one process, but each request decodes all
  of its codes first (the same LM walk, run to completion) and only then vocodes the whole
  utterance (SNAC over all its windows at once): one audio chunk per request.
- ``pipeline`` (baseline b): fixed stages without async chunking, like vLLM-Omni's stage
  pipeline: an LM stage process (this runtime's LM engine, batching the requests it holds) and
  a codec stage process, connected by ZeroMQ; the codec stage takes a request only once all of
  its codes have arrived and vocodes requests one at a time; one audio chunk per request.
- ``sequential`` (baseline c): the streaming runtime serving the N requests one after another
  (each one's times count from the round's start, so its wait for earlier ones is included).

Per request: TTFA (submit to first audio), end-to-end time, RTF (end-to-end / audio seconds) and
playback underruns: a player starts at the first chunk and plays continuously; a chunk that
arrives after all earlier audio finished playing is an underrun, and the gap is stall time. Per
system: audio seconds produced per wall second. Every process runs torch with ``threads``
intra-op threads (1). ``foreign_cores`` records how many cores other processes kept busy
meanwhile (the pipeline's stage processes and the runtime's workers count as the system's own).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import tempfile
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import torch

from mstar_async.bench.common import (
    child_pids,
    cpu_sample,
    foreign_cores,
    machine_info,
    percentile,
    quiet,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.engines import StatelessEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.graph import DynamicLoop, LoopStep, Model, Node, Walk
from mstar_async.loop import run_async
from mstar_async.models import build_model
from mstar_async.models.orpheus.model import SAMPLE_RATE
from mstar_async.models.orpheus.snac_codec import SnacWindowDecoder, decode_offline
from mstar_async.models.orpheus.text import byte_tokenizer, vocab_of
from mstar_async.models.orpheus.vocab import prompt_text
from mstar_async.outputs import AudioChunk, LatentOutput
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.worker.launchers import Launcher

Progress = Callable[[str], None]

PROMPTS = Path(__file__).resolve().parent / "prompts" / "speech_en.txt"
SYSTEMS = ("streaming", "streaming_split", "non_streaming", "pipeline", "sequential")
MODELS = ("orpheus", "qwen3-omni", "qwen3-tts")
#: Systems that need Orpheus' LM/codec split (the baselines a and b are built from its parts).
_ORPHEUS_ONLY = ("non_streaming", "pipeline")
_QWEN_SYSTEMS = ("streaming", "streaming_split", "sequential")
_VOICE, _TEMPERATURE, _TOP_P = "tara", 0.6, 0.8
#: The codec node of each model: ``streaming_split`` puts it on rank 1, the LM on rank 0.
_CODEC_NODE = {"orpheus": "snac", "qwen3-omni": "code2wav", "qwen3-tts": "decoder"}
_STAGE_TIMEOUT_S = 600.0
_WARM_TOKENS = 57


@dataclass(frozen=True)
class SpeechConfig:
    """What to measure.

    ``max_tokens`` bounds every request's speech tokens (orpheus: 7 per 85 ms frame, plus one
    that completes no frame). ``qwen3-omni`` runs only ``streaming`` and ``sequential`` (the
    baselines are built from Orpheus' parts) with ``ignore_eos``.

    Raises:
        ValueError: an unknown model, size or system, or a count below 1.
    """

    model: str = "orpheus"
    size: str = "small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 211
    threads: int = 1
    seed: int = 10
    systems: tuple[str, ...] = SYSTEMS
    quantize: str | None = None
    encoders: str = "seeded"
    ray: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.size not in ("tiny", "small"):
            raise ValueError(f"size must be tiny or small, got {self.size!r}")
        unknown = sorted(set(self.systems) - set(SYSTEMS))
        if unknown or not self.systems:
            raise ValueError(f"systems must be some of {SYSTEMS}, got {self.systems!r}")
        if self.model != "orpheus" and set(self.systems) & set(_ORPHEUS_ONLY):
            raise ValueError(f"{self.model} runs only {_QWEN_SYSTEMS}: drop {_ORPHEUS_ONLY}")
        if self.quantize is not None and self.model != "orpheus":
            raise ValueError(f"quantize is measured for orpheus only, not {self.model}")
        if self.encoders != "seeded" and self.model != "qwen3-tts":
            raise ValueError(f"encoders applies to qwen3-tts only, not {self.model}")
        if self.ray is not None and "streaming_split" not in self.systems:
            raise ValueError("ray runs streaming_split's ranks on a cluster: measure that system")
        if not self.concurrency or min((*self.concurrency, self.max_tokens, self.threads)) < 1:
            raise ValueError(f"concurrency, max_tokens and threads must be >= 1: {self}")


def preset(quick: bool, model: str = "orpheus") -> SpeechConfig:
    """The full workload, or the quick one (tiny model, N = 1 and 4, 43 tokens: 6 frames)."""
    systems = SYSTEMS if model == "orpheus" else _QWEN_SYSTEMS
    if quick:
        max_tokens = 43 if model == "orpheus" else 8
        return SpeechConfig(model, "tiny", (1, 4), max_tokens, systems=systems)
    return SpeechConfig(model, systems=systems, max_tokens=211 if model == "orpheus" else 32)


def configure(base: SpeechConfig, **changes: Any) -> SpeechConfig:
    """``base`` with the changes that are not ``None``.

    Raises:
        ValueError: as ``SpeechConfig``.
    """
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def load_prompts(path: Path = PROMPTS) -> list[str]:
    """The non-empty lines of ``path``.

    Raises:
        ValueError: the file holds no prompt.
        OSError: it cannot be read.
    """
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"{path} holds no prompt (one sentence or a few per line)")
    return prompts


def request_inputs(config: SpeechConfig, index: int, prompts: Sequence[str]) -> dict[str, Any]:
    """The inputs of request ``index``: prompt line ``index`` (cycling), seed ``seed + index``."""
    inputs: dict[str, Any] = {
        "text": prompts[index % len(prompts)],
        "seed": config.seed + index,
        "max_tokens": config.max_tokens,
    }
    if config.model == "orpheus":
        inputs.update(voice=_VOICE, temperature=_TEMPERATURE, top_p=_TOP_P)
    elif config.model == "qwen3-tts":
        inputs["speaker"] = "ryan"  # max_tokens counts frames (80 ms each)
    else:
        inputs["ignore_eos"] = True
    return inputs


# --- the player -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Playback:
    """What a listener heard: how many chunks came late and for how long playback stalled."""

    underruns: int
    stall_s: float


def simulate_playback(chunks: Sequence[tuple[float, float]]) -> Playback:
    """Play ``chunks`` (arrival time, audio seconds), in order, from the first one's arrival.

    A chunk arriving after the end of all earlier audio is an underrun: playback stalls from
    that end until the chunk arrives, then resumes with it. The first chunk is never one.
    """
    underruns, stall, end = 0, 0.0, None
    for arrival, seconds in chunks:
        if end is None:
            end = arrival
        elif arrival > end:
            underruns += 1
            stall += arrival - end
            end = arrival
        end += seconds
    return Playback(underruns, stall)


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's figures, times in seconds from its submission."""

    ttfa_s: float
    e2e_s: float
    audio_s: float
    chunks: int
    underruns: int
    stall_s: float

    @property
    def rtf(self) -> float:
        """End-to-end time over audio duration (< 1 is faster than real time)."""
        return self.e2e_s / self.audio_s


def timing_of(chunks: Sequence[tuple[float, float]], e2e_s: float) -> RequestTiming:
    """A request's figures from its chunks (arrival time, audio seconds) and its end time.

    Raises:
        RuntimeError: it made no audio (its RTF would be undefined).
    """
    audio = sum(seconds for _, seconds in chunks)
    if not chunks or audio <= 0:
        raise RuntimeError("a request made no audio: raise max_tokens or pick other seeds")
    played = simulate_playback(chunks)
    return RequestTiming(chunks[0][0], e2e_s, audio, len(chunks), played.underruns, played.stall_s)


# --- the systems that run in this process ---------------------------------------------------


async def stream_one(
    runtime: Runtime, inputs: dict[str, Any], arrived: float | None = None
) -> RequestTiming:
    """Run one request, timing each ``AudioChunk`` as it arrives, from ``arrived`` (a
    ``perf_counter`` time; default: now)."""
    started = time.perf_counter() if arrived is None else arrived
    chunks: list[tuple[float, float]] = []
    async with runtime.generate(**inputs) as outputs:
        async for item in outputs:
            if isinstance(item, AudioChunk) and item.pcm.numel():
                chunks.append((time.perf_counter() - started, item.seconds))
    return timing_of(chunks, time.perf_counter() - started)


async def run_concurrent(
    runtime: Runtime, requests: Sequence[dict[str, Any]]
) -> tuple[list[RequestTiming], float]:
    """``requests`` submitted at once: their timings and the wall time until the last ended."""
    timings: list[RequestTiming] = []

    async def one(inputs: dict[str, Any]) -> None:
        timings.append(await stream_one(runtime, inputs))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for inputs in requests:
            tg.start_soon(one, inputs)
    return timings, time.perf_counter() - started


async def run_sequential(
    runtime: Runtime, requests: Sequence[dict[str, Any]]
) -> tuple[list[RequestTiming], float]:
    """``requests``, all arrived now, served one after another: their timings (from now, so
    a request's wait for those before it counts) and the wall time until the last ended."""
    arrived = time.perf_counter()
    timings = [await stream_one(runtime, inputs, arrived) for inputs in requests]
    return timings, time.perf_counter() - arrived


# --- baseline models built from Orpheus' parts ----------------------------------------------


class UtteranceVocoder:
    """Codec op ``utterance``: each request's whole token list -> all of its PCM, decoded with
    the same windows as the stream (``decode_offline``), so the samples equal the streamed ones."""

    def __init__(self, decoder: SnacWindowDecoder) -> None:
        self.decoder = decoder

    def __call__(self, codes: Any) -> dict[str, list[torch.Tensor]]:
        rows = [row.reshape(-1).tolist() for row in codes]
        return {"pcm": [decode_offline(tokens, self.decoder) for tokens in rows]}


def snac_decoder(size: str, seed: int = 0) -> SnacWindowDecoder:
    """The codec op of ``orpheus`` at ``size`` (the very weights its ``snac`` engine gets)."""
    engine = build_model("orpheus", size=size, seed=seed).components["snac"]()
    decoder = engine.ops["decode"]
    assert isinstance(decoder, SnacWindowDecoder)
    return decoder


def _until(end_of_speech: int) -> Callable[[LoopStep], bool]:
    def until(step: LoopStep) -> bool:
        if int(step.outputs["decode.token"]) == end_of_speech:
            return True
        return step.iteration + 1 >= int(step.params["max_tokens"])

    return until


def lm_options(quantize: str | None) -> dict[str, Any]:
    """Orpheus' builder options for an LM in weight form ``quantize`` (``None``: as built):
    quantized linears run with bfloat16 activations, where torch's kernels are fast."""
    return {} if quantize is None else {"quantize": quantize, "dtype": "bfloat16"}


def codes_model(size: str, *, vocode: bool, seed: int = 0, quantize: str | None = None) -> Model:
    """Orpheus' LM (same weights, prompt and sampling) without streaming to the codec.

    Its program runs the decode loop to completion, collecting every code; then, with
    ``vocode``, it vocodes the whole utterance on a ``snac`` engine (``UtteranceVocoder``) and
    yields one ``AudioChunk``; without, it yields the codes as a ``LatentOutput`` (the LM stage of
    the pipeline). Raises ``ValueError`` for an unknown size.
    """
    base = build_model("orpheus", size=size, seed=seed, **lm_options(quantize))
    tokenizer = byte_tokenizer()
    vocab = vocab_of(tokenizer)
    nodes = [
        Node("prefill", engine="lm", inputs=["tokens", "sampling"], outputs=["token"]),
        Node("decode", engine="lm", inputs=["token"], outputs=["token"]),
    ]
    speak = DynamicLoop(
        "decode",
        until=_until(vocab.end_of_speech),
        max_iterations=4096,
        carry={"decode.token": "decode.token"},
    )
    walks = [
        Walk("prefill", "prefill", outputs=["prefill.token"]),
        Walk("codes", speak, outputs=["decode.token"]),
    ]
    components: dict[str, Callable[[], Any]] = {"lm": base.components["lm"]}
    if vocode:
        snac = base.components["snac"]
        nodes.append(
            Node("vocode", engine="snac", op="utterance", inputs=["codes"], outputs=["pcm"])
        )
        walks.append(Walk("vocode", "vocode", outputs=["vocode.pcm"]))
        components["snac"] = lambda: StatelessEngine(
            {"utterance": UtteranceVocoder(snac().ops["decode"])}
        )

    async def program(
        request: Any,
        text: str,
        voice: str = _VOICE,
        max_tokens: int = 1200,
        temperature: float = _TEMPERATURE,
        top_p: float = _TOP_P,
        seed: int = 0,
    ) -> AsyncGenerator[Any, None]:
        ids = vocab.prompt_ids(tokenizer.encode(prompt_text(text, voice), add_special_tokens=True))
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=frozenset({vocab.end_of_speech}),
        )
        await request.run("prefill", tokens=torch.tensor(ids[:-1]), sampling=sampling)
        codes: list[int] = []
        first = torch.tensor(ids[-1])
        async with request.stream("codes", params={"max_tokens": max_tokens}, token=first) as s:
            async for event in s:
                codes.append(int(event.value))
        if not vocode:
            yield LatentOutput(torch.tensor(codes))
            return
        out = await request.run("vocode", codes=torch.tensor(codes))
        yield AudioChunk(out["vocode.pcm"], SAMPLE_RATE)

    return Model(
        "orpheus-non-streaming" if vocode else "orpheus-codes",
        nodes=nodes,
        walks=walks,
        program=program,
        components=components,
        description=f"orpheus {size}: all codes first, then the codec" if vocode else "",
    )


# --- baseline b: a fixed two-stage pipeline in two processes --------------------------------


def _lm_stage(
    size: str, seed: int, threads: int, quantize: str | None, requests: str, codes: str
) -> None:
    """LM stage process: requests in, each request's complete codes out (``None`` stops it)."""
    torch.set_num_threads(threads)
    anyio.run(_lm_stage_main, size, seed, quantize, requests, codes)


async def _lm_stage_main(
    size: str, seed: int, quantize: str | None, requests: str, codes: str
) -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(requests)
    outbox.bind(codes)

    async def one(runtime: Runtime, rid: int, inputs: dict[str, Any]) -> None:
        async with runtime.generate(**inputs) as outputs:
            tokens = [item.latent.tolist() async for item in outputs]
        await outbox.send_pyobj((rid, tokens[0]))

    try:
        model = codes_model(size, vocode=False, seed=seed, quantize=quantize)
        async with open_runtime(model) as runtime:
            async with anyio.create_task_group() as tg:
                while (message := await inbox.recv_pyobj()) is not None:
                    tg.start_soon(one, runtime, *message)
        await outbox.send_pyobj(None)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        context.term()


def _codec_stage(size: str, seed: int, threads: int, codes: str, results: str) -> None:
    """Codec stage process: one request's complete codes at a time in, its whole PCM out."""
    import zmq

    torch.set_num_threads(threads)
    decoder = snac_decoder(size, seed)
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(codes)
    outbox.connect(results)
    try:
        outbox.send_pyobj(("ready", None))
        while (message := inbox.recv_pyobj()) is not None:
            rid, tokens = message
            pcm = decode_offline(tokens, decoder)
            outbox.send_pyobj((rid, (pcm.numpy(), decoder.sample_rate)))
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        context.term()


class Pipeline:
    """The two stage processes and this process's ends of their sockets. ``start`` them, ``run``
    rounds of requests, then ``close``. Not safe to use from two threads at once.

    Raises:
        RuntimeError: a stage died or did not answer within ``_STAGE_TIMEOUT_S``.
    """

    def __init__(self, size: str, threads: int, seed: int = 0, quantize: str | None = None) -> None:
        import zmq

        self._folder = tempfile.TemporaryDirectory(prefix="mstar-speech-")
        address = f"ipc://{self._folder.name}/%s"
        self._context = zmq.Context()
        self._requests, self._results = (
            self._context.socket(zmq.PUSH),
            self._context.socket(zmq.PULL),
        )
        self._requests.bind(address % "requests")
        self._results.bind(address % "results")
        self._started = self._ready = False
        spawn = multiprocessing.get_context("spawn")
        self.stages = [
            spawn.Process(
                target=_lm_stage,
                args=(size, seed, threads, quantize, address % "requests", address % "codes"),
                daemon=True,
            ),
            spawn.Process(
                target=_codec_stage,
                args=(size, seed, threads, address % "codes", address % "results"),
                daemon=True,
            ),
        ]

    def start(self) -> None:
        """Start the stage processes (they build their models meanwhile; ``run`` waits)."""
        for stage in self.stages:
            stage.start()
        self._started = True

    def close(self) -> None:
        """Stop the stages (asking first, then terminating) and close the sockets."""
        try:
            if not self._started:
                return
            import zmq

            with contextlib.suppress(zmq.Again):  # no LM stage to hear it: terminated below
                self._requests.send_pyobj(None, flags=zmq.NOBLOCK)
            for stage in self.stages:
                stage.join(timeout=30)
        finally:
            for stage in self.stages:
                if stage.is_alive():
                    stage.terminate()
                    stage.join(timeout=5)
            self._requests.close(linger=0)
            self._results.close(linger=0)
            self._context.term()
            self._folder.cleanup()

    def _receive(self) -> tuple[Any, Any]:
        deadline = time.monotonic() + _STAGE_TIMEOUT_S
        while not self._results.poll(1000):
            dead = [s.name for s in self.stages if s.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"pipeline stage(s) {dead or 'silent'}: no result")
        message: tuple[Any, Any] = self._results.recv_pyobj()
        return message

    def run(self, requests: Sequence[dict[str, Any]]) -> tuple[list[RequestTiming], float]:
        """Send ``requests`` at once; their timings and the wall time until the last came back.

        Raises:
            RuntimeError: a stage died or did not answer.
        """
        if not self._ready:
            self._receive()  # the codec stage says it is up
            self._ready = True
        started = time.perf_counter()
        for rid, inputs in enumerate(requests):
            self._requests.send_pyobj((rid, inputs))
        timings: list[RequestTiming] = []
        for _ in requests:
            _, (pcm, rate) = self._receive()
            ended = time.perf_counter() - started
            timings.append(timing_of([(ended, len(pcm) / rate)], ended))
        return timings, time.perf_counter() - started


# --- measuring and reporting ----------------------------------------------------------------


def _figures(
    timings: Sequence[RequestTiming], wall: float, foreign: float | None
) -> dict[str, Any]:
    def p(values: list[float], q: float) -> float:
        return round(percentile(values, q), 4)

    ttfa, e2e = [t.ttfa_s for t in timings], [t.e2e_s for t in timings]
    rtf, audio = [t.rtf for t in timings], [t.audio_s for t in timings]
    return {
        "requests": len(timings),
        "ttfa_p50_s": p(ttfa, 50),
        "ttfa_p95_s": p(ttfa, 95),
        "e2e_p50_s": p(e2e, 50),
        "e2e_p95_s": p(e2e, 95),
        "rtf_p50": p(rtf, 50),
        "rtf_p95": p(rtf, 95),
        "audio_s_p50": p(audio, 50),
        "audio_s_total": round(sum(audio), 4),
        "chunks_per_request_p50": p([float(t.chunks) for t in timings], 50),
        "throughput_audio_s_per_s": round(sum(audio) / wall, 4),
        "underruns": sum(t.underruns for t in timings),
        "requests_with_underruns": sum(1 for t in timings if t.underruns),
        "stall_s_total": round(sum(t.stall_s for t in timings), 4),
        "stall_s_p50": p([t.stall_s for t in timings], 50),
        "wall_s": round(wall, 4),
        "foreign_cores": None if foreign is None else round(foreign, 3),
    }


@dataclass
class _Systems:
    streaming: Runtime | None = None
    split: Runtime | None = None
    non_streaming: Runtime | None = None
    pipeline: Pipeline | None = None


async def _measure(
    system: str, systems: _Systems, requests: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    gc.collect()
    # Worker and stage processes are the measured system's own CPU time; idle ones add ~0.
    children = child_pids()
    before = cpu_sample(children)
    if system == "pipeline":
        assert systems.pipeline is not None
        timings, wall = await anyio.to_thread.run_sync(systems.pipeline.run, requests)
    elif system == "streaming_split":
        assert systems.split is not None
        timings, wall = await run_concurrent(systems.split, requests)
    elif system == "non_streaming":
        assert systems.non_streaming is not None
        timings, wall = await run_concurrent(systems.non_streaming, requests)
    else:
        assert systems.streaming is not None
        run = run_sequential if system == "sequential" else run_concurrent
        timings, wall = await run(systems.streaming, requests)
    return _figures(timings, wall, foreign_cores(before, cpu_sample(children)))


#: The runtime's two layouts: one process, and LM and codec on worker processes of their own.
OURS = ("streaming", "streaming_split")


def _aims_of(ours: str, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    first, last = results[0], results[-1]
    aims: list[dict[str, Any]] = []
    if {ours, "non_streaming"} <= set(first["systems"]):
        n = first["concurrency"]
        value = (
            first["systems"][ours]["ttfa_p50_s"] / first["systems"]["non_streaming"]["e2e_p50_s"]
        )
        aims.append(
            aim_entry(
                f"{ours}: TTFA p50 at N={n} <= 0.2x non_streaming's end-to-end p50",
                0.2,
                round(value, 4),
                compare="<=",
                system=ours,
                concurrency=n,
            )
        )
    if {ours, "sequential"} <= set(last["systems"]):
        n = last["concurrency"]
        aims.append(
            aim_entry(
                f"{ours}: throughput at N={n} >= 3x sequential",
                3.0,
                last["ratios"]["throughput"][f"{ours}/sequential"],
                system=ours,
                concurrency=n,
            )
        )
    if all({ours, "pipeline"} <= set(r["systems"]) for r in results):
        values = {
            str(r["concurrency"]): r["ratios"]["rtf_p50"][f"{ours}/pipeline"] for r in results
        }
        aims.append(
            aim_entry(
                f"{ours}: RTF p50 below pipeline's at every N (the worst N's ratio)",
                1.0,
                max(values.values()),
                compare="<",
                system=ours,
                by_concurrency=values,
            )
        )
    return aims


def _aims(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout of the runtime, the three aims: measured value, target, whether met."""
    return [
        entry for ours in OURS if ours in results[0]["systems"] for entry in _aims_of(ours, results)
    ]


#: What each system runs, for the report's ``systems``.
_DESCRIPTIONS = {
    "streaming": "the runtime in one process: LM decode steps batched across requests, every "
    "frame's 7 codes streaming to SNAC in a window of up to 28 tokens (one frame before, two "
    "after)",
    "streaming_split": "the same with LM and codec on worker processes of their own",
    "non_streaming": "(a) each request decodes all its codes, then vocodes the whole utterance",
    "pipeline": "(b) an LM stage process and a codec stage process over ZeroMQ; the codec "
    "takes a request once all its codes arrived, one request at a time",
    "sequential": "(c) the streaming runtime, the N requests one after another",
}


def _describe(system: str, config: SpeechConfig) -> str:
    if system == "streaming_split" and config.ray is not None:
        return (
            f"{_DESCRIPTIONS[system]}, as Ray actors on two nodes of the cluster at {config.ray} "
            "(STRICT_SPREAD), over ZeroMQ TCP with CURVE"
        )
    return _DESCRIPTIONS[system]


def _ratios(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    ratios: dict[str, dict[str, float]] = {"throughput": {}, "rtf_p50": {}, "ttfa_p50": {}}
    for ours in OURS:
        mine = figures.get(ours)
        for name, other in figures.items():
            if mine is None or name in OURS:
                continue
            key = f"{ours}/{name}"
            ratios["throughput"][key] = round(
                mine["throughput_audio_s_per_s"] / other["throughput_audio_s_per_s"], 4
            )
            ratios["rtf_p50"][key] = round(mine["rtf_p50"] / other["rtf_p50"], 4)
            ratios["ttfa_p50"][key] = round(mine["ttfa_p50_s"] / other["ttfa_p50_s"], 4)
    return ratios


async def run_speech(config: SpeechConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Measure ``config``; the report as a JSON-ready dict.

    Raises:
        RuntimeError: a request made no audio, or a pipeline stage died.
        OSError, ValueError: the prompt file cannot be read or is empty.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return await _run(config, progress)
    finally:
        torch.set_num_threads(threads)


async def _warm(runtime: Runtime, inputs: dict[str, Any]) -> None:
    # The first forwards pay for allocation and kernel selection; a short request absorbs them.
    await run_concurrent(
        runtime, [{**inputs, "max_tokens": min(inputs["max_tokens"], _WARM_TOKENS)}]
    )


async def _round(
    config: SpeechConfig,
    systems: _Systems,
    index: int,
    n: int,
    prompts: Sequence[str],
    progress: Progress,
) -> dict[str, Any]:
    requests = [request_inputs(config, i, prompts) for i in range(n)]
    figures: dict[str, dict[str, Any]] = {}
    # Each round starts with another system: a shared machine's load drifts, and whoever ran
    # first at every N would meet the same part of the drift.
    shift = index % len(config.systems)
    for system in (*config.systems[shift:], *config.systems[:shift]):
        figures[system] = f = await _measure(system, systems, requests)
        progress(
            f"N={n} {system}: TTFA p50 {f['ttfa_p50_s']:.2f} s, RTF p50 {f['rtf_p50']:.2f}, "
            f"{f['throughput_audio_s_per_s']:.2f} audio s/s, {f['underruns']} underruns, "
            f"foreign cores {f['foreign_cores']}"
        )
    ordered = {system: figures[system] for system in config.systems}
    return {"concurrency": n, "systems": ordered, "ratios": _ratios(ordered)}


async def _open(config: SpeechConfig, stack: AsyncExitStack, progress: Progress) -> _Systems:
    systems = _Systems()
    warm = request_inputs(config, 0, load_prompts())
    if "pipeline" in config.systems:
        # Started first: its processes import torch and build their engines meanwhile.
        systems.pipeline = pipeline = Pipeline(
            config.size, config.threads, quantize=config.quantize
        )
        stack.callback(pipeline.close)
        pipeline.start()
    progress(f"opening {config.model} ({config.size}); systems: {', '.join(config.systems)}")
    options = lm_options(config.quantize)
    if config.model == "qwen3-tts":
        options["encoders"] = config.encoders
    model = build_model(config.model, size=config.size, **options)
    systems.streaming = await stack.enter_async_context(open_runtime(model))
    await _warm(systems.streaming, warm)
    if "streaming_split" in config.systems:
        placement, launcher = _split_layout(config)
        split = build_model(config.model, size=config.size, **options)
        systems.split = await stack.enter_async_context(
            open_runtime(split, placement=placement, launcher=launcher)
        )
        await _warm(systems.split, warm)
    if "non_streaming" in config.systems:
        baseline = codes_model(config.size, vocode=True, quantize=config.quantize)
        systems.non_streaming = await stack.enter_async_context(open_runtime(baseline))
        await _warm(systems.non_streaming, warm)
    if systems.pipeline is not None:
        short = {**warm, "max_tokens": min(config.max_tokens, _WARM_TOKENS)}
        await anyio.to_thread.run_sync(systems.pipeline.run, [short])
    return systems


def _split_layout(config: SpeechConfig) -> tuple[Placement, Launcher | None]:
    """``streaming_split``'s placement (the codec on rank 1), and with ``config.ray`` the
    launcher that puts its two ranks on two nodes of that Ray cluster."""
    node = _CODEC_NODE[config.model]
    if config.ray is None:
        return Placement(nodes={node: 1}), None
    from mstar_async.transport import CurveKeys
    from mstar_async.worker.launchers import RayLauncher

    placement = Placement(nodes={node: 1}, strategy="STRICT_SPREAD")
    keys = CurveKeys.for_run()
    return placement, RayLauncher.for_placement(placement, config.ray, curve_keys=keys)


async def _run(config: SpeechConfig, progress: Progress) -> dict[str, Any]:
    machine = machine_info()
    prompts = load_prompts()
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    async with AsyncExitStack() as stack:
        systems = await _open(config, stack, progress)
        for index, n in enumerate(config.concurrency):
            results.append(await _round(config, systems, index, n, prompts, progress))
        voices = None
        if config.model == "qwen3-tts":
            voices = await _voices(config, systems, prompts, progress)
    machine["load_average_end"] = machine_info()["load_average"]
    report = make_report(
        "speech",
        workload={
            **asdict(config),
            "concurrency": list(config.concurrency),
            "systems": list(config.systems),
            "prompts": PROMPTS.relative_to(PROMPTS.parents[3]).as_posix(),
            "sampling": "voice tara, temperature 0.6, top_p 0.8, seed = seed + request index"
            if config.model == "orpheus"
            else "greedy text, seeded speech, ignore_eos",
        },
        machine=machine,
        systems=[system_entry(name, _describe(name, config)) for name in config.systems],
        results=results,
        aims=_aims(results) + (voices["aims"] if voices else []),
        seconds=time.perf_counter() - started,
    )
    if voices:
        report["voices"] = voices
    return report


async def _voices(
    config: SpeechConfig, systems: _Systems, prompts: Sequence[str], progress: Progress
) -> dict[str, Any]:
    """qwen3-tts: the cloned-voice rows (``speech_voices``), twelve requests per kind (with
    six, a difference of 15 ms was lost in the noise)."""
    from mstar_async.bench.speech_voices import measure_voices

    assert systems.streaming is not None
    requests = [request_inputs(config, i, prompts) for i in range(12)]
    for base in requests:
        base.pop("speaker", None)
    voices = await measure_voices(
        systems.streaming, requests, stream_one=stream_one, figures=_figures
    )
    for kind, f in voices["systems"].items():
        progress(f"cloned voices, {kind}: TTFA p50 {f['ttfa_p50_s']:.3f} s, RTF {f['rtf_p50']:.2f}")
    return voices


def run_speech_sync(config: SpeechConfig, progress: Progress = quiet) -> dict[str, Any]:
    """``run_speech`` on a fresh event loop (uvloop where installed)."""
    report: dict[str, Any] = run_async(run_speech, config, progress)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a table per concurrency, the ratios to each baseline and the aims."""
    work, machine = report["workload"], report["machine"]
    lines = [
        f"speech benchmark: {work['model']} {work['size']}, {work['max_tokens']} max tokens, "
        f"{work['threads']} torch thread(s) per process, {report['seconds']:.0f} s"
        + (", encoders at the released shapes" if work.get("encoders") == "released" else ""),
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, load average "
        f"{machine['load_average']} -> {machine.get('load_average_end')}",
        "",
    ]
    header = (
        f"{'N':>3} {'system':<15} | {'TTFA p50':>8} | {'TTFA p95':>8} | {'e2e p50':>7} | "
        f"{'RTF p50':>7} | {'RTF p95':>7} | {'audio s/s':>9} | {'underruns':>9} | "
        f"{'stall s':>7} | {'foreign':>7}"
    )
    lines += [header, "-" * len(header)]
    for result in report["results"]:
        for name, f in result["systems"].items():
            foreign = "-" if f["foreign_cores"] is None else f"{f['foreign_cores']:.2f}"
            lines.append(
                f"{result['concurrency']:>3} {name:<15} | {f['ttfa_p50_s']:>8.2f} | "
                f"{f['ttfa_p95_s']:>8.2f} | {f['e2e_p50_s']:>7.2f} | {f['rtf_p50']:>7.2f} | "
                f"{f['rtf_p95']:>7.2f} | {f['throughput_audio_s_per_s']:>9.3f} | "
                f"{f['underruns']:>9} | {f['stall_s_total']:>7.2f} | {foreign:>7}"
            )
        ratios = result["ratios"].get("throughput", {})
        if ratios:
            text = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            lines.append(f"    throughput {text}")
    if voices := report.get("voices"):
        lines.append(
            f"cloned voices (N=1, {voices['reference_seconds']:g} s reference, "
            f"{voices['reference_frames']} frames; the registered voice keeps "
            f"{voices['kept_prompt_rows']} prompt rows, its timed requests took "
            f"{voices['reused_prompt_rows']} from them):"
        )
        for kind, f in voices["systems"].items():
            lines.append(
                f"    {kind:<19} TTFA p50 {f['ttfa_p50_s']:.3f} s, p95 {f['ttfa_p95_s']:.3f} s, "
                f"e2e p50 {f['e2e_p50_s']:.2f} s"
            )
    for entry in report["aims"]:
        verdict = "met" if entry["met"] else "NOT met"
        lines.append(f"aim {entry['name']}: {entry['measured']}: {verdict}")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str | Path) -> bool:
    """Draw RTF p50 (bars to p95) and TTFA p50 against concurrency, one line per system, into
    ``path`` (a PNG). Returns False, drawing nothing, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    ns = [r["concurrency"] for r in results]
    fig, (rtf_ax, ttfa_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for system in (entry["name"] for entry in report["systems"]):
        cells = [r["systems"][system] for r in results]
        p50 = [c["rtf_p50"] for c in cells]
        up = [c["rtf_p95"] - c["rtf_p50"] for c in cells]
        rtf_ax.errorbar(ns, p50, yerr=[[0] * len(ns), up], fmt="o-", capsize=3, label=system)
        ttfa_ax.plot(ns, [c["ttfa_p50_s"] for c in cells], "o-", label=system)
    work = report["workload"]
    rtf_ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    for ax, label in ((rtf_ax, "RTF p50 (bar to p95)"), (ttfa_ax, "time to first audio p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{work['model']} {work['size']}, {work['max_tokens']} tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    """``python -m mstar_async.bench.speech [--quick]``: print the report (``mstar bench
    speech`` has every option)."""
    import sys

    from mstar_async.bench.common import ProgressLog

    report = run_speech_sync(preset("--quick" in sys.argv[1:]), ProgressLog())
    print(format_report(report))


if __name__ == "__main__":
    main()
