"""Decode throughput: the runtime against transformers and against a hand-written engine loop.

Workload (the defaults): SmolLM2-135M-Instruct, bfloat16 and float32, prompts of exactly 64
tokens, 128 new tokens per request with EOS ignored (so every request makes exactly 128),
greedy, at 1, 8 and 32 concurrent requests. Five systems run on the same weights:

- ``runtime``: the ``causal-lm`` model served by ``open_runtime`` in this process; N tasks
  each run ``runtime.generate(...)`` at once on the caller's event loop (uvloop under the
  CLI). Throughput is all generated tokens over the wall time from the first submit to the
  last output. The engine is wrapped in a counter so generated tokens are counted, not
  assumed.
- ``one-worker``: the same model, prompts and token counts, served by
  ``open_runtime(model, placement=Placement.single())``: the engine and its batching loop run
  in one worker process, the conductor (request programs, detokenizer) in this one, steps
  crossing over ZeroMQ IPC. There is no engine here to wrap, so generated tokens are counted
  from the program's outputs: each request's ``completion_tokens`` (its closing ``TextEnd``,
  as ``RequestStream.metrics`` records it). The worker rank runs torch with as many threads
  as torch has in this process (the other systems' count), so the two runtimes compute their
  forwards alike; this process keeps its threads too, and the two processes share the cores.
- ``transformers``: ``AutoModelForCausalLM.generate`` (greedy, ``min_new_tokens`` =
  ``max_new_tokens``), one request after another. Sequential requests all run at one rate,
  so unless every request is measured (``--full``) a few are, and tokens/s is their rate
  (the report says so).
- ``transformers-static``: the same model and generation settings, the N prompts as one
  static batch of one ``generate`` call (every prompt has the same length, so no padding):
  the batched baseline a serving system must beat at N > 1.
- ``handloop``: our ``KVCacheEngine`` driven by a plain loop: one ``forward`` with N prefill
  steps, then ``new_tokens - 1`` forwards of N decode steps. No graph, no scheduling, no
  detokenizer: the floor the runtime's overhead is measured against.

Both baselines compute on a worker thread, as the in-process runtime's engine does.

Noise control: each system is warmed up at every concurrency first; then, per concurrency,
the systems run one at a time in alternating order (one-worker, runtime, handloop,
transformers; then the reverse; ...), one pass per repetition.
Ratios are taken within a repetition (back-to-back measurements) and then summarised by
median, min and max. Every measurement records how many cores other processes kept busy
meanwhile (the worker process of ``one-worker`` counts as its own); a repetition disturbed by
more than ``max_foreign_cores`` is measured again (on 2 cores a competing process slows
2-thread torch by up to 10x, so such figures would describe the neighbour, not us).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import torch

from mstar_async.bench.common import (
    CpuSample,
    ProgressLog,
    cpu_sample,
    foreign_cores,
    machine_info,
    quiet,
    ratio_table,
    summarize,
)
from mstar_async.bench.report import aim_entry, make_report, system_entry
from mstar_async.engines.base import Engine, Step, StepResult
from mstar_async.engines.kv import bytes_per_block
from mstar_async.engines.kv_engine import KVCacheEngine
from mstar_async.engines.sampling import SamplingParams
from mstar_async.errors import MstarError
from mstar_async.loop import run_async
from mstar_async.models import build_model
from mstar_async.models.causal_lm import (
    DEFAULT_KV_CACHE_BYTES,
    build_causal_lm,
    build_lm_engine,
)
from mstar_async.models.checkpoints import ChatTokenizer, smollm2_folder
from mstar_async.outputs import TextDelta
from mstar_async.placement import Placement
from mstar_async.runtime import Runtime, open_runtime
from mstar_async.transport import CurveKeys
from mstar_async.worker.launchers import LocalLauncher, WorkerHandle
from mstar_async.worker.main import WorkerConfig

__all__ = [
    "AIMS",
    "RATIOS",
    "SYSTEMS",
    "Aim",
    "BenchmarkError",
    "DecodeConfig",
    "Measurement",
    "Prompt",
    "RuntimeSystem",
    "TransformersSystem",
    "build_prompts",
    "check_tokens",
    "configure",
    "contamination",
    "format_report",
    "kv_cache_bytes_for",
    "measure",
    "preset",
    "run_decode",
    "run_decode_sync",
    "transformers_model",
]

Progress = Callable[[str], None]

#: The systems, in the order of the first repetition (later repetitions reverse it). The
#: in-process runtime sits between the one-worker runtime and the hand loop either way: its
#: ratios to those two are the finer ones (0.9x aims), so those measurements are the ones kept
#: back to back.
SYSTEMS = ("one-worker", "runtime", "handloop", "transformers", "transformers-static")

#: The ratios reported for every (dtype, concurrency): numerator system / denominator system.
RATIOS = (
    ("runtime", "transformers"),
    ("runtime", "transformers-static"),
    ("runtime", "handloop"),
    ("one-worker", "runtime"),
)

#: The dtypes measured, by the names ``causal-lm`` takes.
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Block size of the engine's paged KV cache (the engine default).
_KV_BLOCK_SIZE = 16


class BenchmarkError(MstarError):
    """The benchmark cannot produce honest figures (a system made the wrong number of tokens,
    a prompt of the requested length cannot be built, a configuration is invalid)."""


@dataclass(frozen=True, slots=True)
class Aim:
    """A target the runtime should reach: ``ratio`` >= ``target`` at ``concurrency``."""

    ratio: str
    concurrency: int
    target: float

    def describe(self) -> str:
        """The aim in words, e.g. ``runtime >= 10x transformers at N=32``."""
        numerator, denominator = self.ratio.split("/")
        return f"{numerator} >= {self.target:g}x {denominator} at N={self.concurrency}"


#: What the issue asks of the runtime.
AIMS = (
    Aim("runtime/transformers", 32, 10.0),
    Aim("runtime/handloop", 32, 0.9),
    Aim("runtime/transformers", 1, 1.5),
    Aim("one-worker/runtime", 32, 0.9),
    Aim("runtime/transformers-static", 32, 2.0),
)


@dataclass(frozen=True)
class DecodeConfig:
    """What to measure.

    Attributes:
        folder: a Hugging Face checkpoint folder; ``None`` means SmolLM2-135M-Instruct.
        dtypes: ``"bfloat16"`` and/or ``"float32"``.
        concurrency: the numbers of concurrent requests to measure.
        prompt_tokens: exact length of every prompt, in tokens.
        new_tokens: tokens every request generates (EOS is ignored).
        repeat: repetitions of every (dtype, concurrency, system) measurement.
        transformers_requests: how many of the N sequential transformers requests to time per
            repetition (tokens/s is their rate); ``None`` times all N.
        warmup_tokens: new tokens per request in the warm-up rounds.
        max_foreign_cores: a repetition in which other processes kept more than this many
            cores busy (on average, during any one of its measurements) is contaminated.
        retries: how many times a contaminated repetition is measured again before it is
            kept anyway (and reported as contaminated).
        mode: a label for the report (``quick``, ``default``, ``full``).
    """

    folder: Path | None = None
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 64
    new_tokens: int = 128
    repeat: int = 3
    transformers_requests: int | None = 4
    warmup_tokens: int = 16
    max_foreign_cores: float = 0.25
    retries: int = 2
    mode: str = "default"

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            BenchmarkError: a field is out of range (the message names it).
        """
        unknown = [d for d in self.dtypes if d not in _TORCH_DTYPES]
        if not self.dtypes or unknown:
            raise BenchmarkError(f"dtypes must be among {sorted(_TORCH_DTYPES)}, got {self.dtypes}")
        if not self.concurrency or any(n < 1 for n in self.concurrency):
            raise BenchmarkError(f"concurrency must be ints >= 1, got {self.concurrency}")
        for name in ("prompt_tokens", "new_tokens", "repeat", "warmup_tokens"):
            if getattr(self, name) < 1:
                raise BenchmarkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or not self.max_foreign_cores >= 0:
            raise BenchmarkError(
                f"retries and max_foreign_cores must be >= 0, got {self.retries} and "
                f"{self.max_foreign_cores}"
            )
        if self.transformers_requests is not None and self.transformers_requests < 1:
            raise BenchmarkError(
                f"transformers_requests must be >= 1 or None, got {self.transformers_requests}"
            )


def preset(mode: str) -> DecodeConfig:
    """The configuration of ``mode``: ``default`` (the issue's workload, transformers timed
    on 4 requests per concurrency), ``full`` (the same, every transformers request timed) or
    ``quick`` (bfloat16, N in {1, 8}, 32 new tokens, one repetition; a minute or two).

    Raises:
        BenchmarkError: an unknown mode.
    """
    if mode == "default":
        return DecodeConfig()
    if mode == "full":
        return DecodeConfig(transformers_requests=None, mode="full")
    if mode == "quick":
        return DecodeConfig(
            dtypes=("bfloat16",),
            concurrency=(1, 8),
            new_tokens=32,
            repeat=1,
            transformers_requests=2,
            warmup_tokens=8,
            retries=0,
            mode="quick",
        )
    raise BenchmarkError(f"unknown mode {mode!r}; modes: quick, default, full")


# --------------------------------------------------------------------------- prompts

_WORDS = (
    "river mountain lantern harbor quiet orange engine signal garden window paper silver "
    "morning winter market bridge copper thunder meadow pocket candle forest island ladder "
    "shadow planet violin basket rocket mirror whistle canyon blanket tunnel feather pepper "
    "compass marble velvet anchor saddle ribbon meteor orchard pillow kettle glacier"
).split()
_JOINERS = ("the", "a", "and", "of", "near", "with", "under", "beside", "over", "past")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as text (what the runtime is sent) and the exact ids that text encodes to."""

    text: str
    ids: tuple[int, ...]


def _prose(seed: int, words: int) -> str:
    # Varied, ordinary English-like text, different for every request: requests of a batch
    # should not share a prompt (nor, greedy, their whole continuation).
    rng = random.Random(seed)
    parts: list[str] = []
    for i in range(words):
        parts.append(rng.choice(_JOINERS) if i % 3 == 1 else rng.choice(_WORDS))
        if i % 11 == 10:
            parts[-1] += "."
    return f"Story {seed}: " + " ".join(parts)


def build_prompts(tokenizer: ChatTokenizer, count: int, length: int) -> list[Prompt]:
    """``count`` different prompts whose text encodes to exactly ``length`` tokens.

    Each is a window of ``length`` ids of some generated prose whose decoded text encodes back
    to exactly those ids, so the runtime (which tokenizes text) and the baselines (which take
    ids) process the same tokens.

    Raises:
        BenchmarkError: no such window exists in the generated text (a very odd tokenizer).
    """
    prompts: list[Prompt] = []
    for index in range(count):
        ids = tokenizer.encode(_prose(index, 4 * length + 32))
        for start in range(max(1, len(ids) - length + 1)):
            window = ids[start : start + length]
            text = tokenizer.decode(window, skip_special_tokens=False)
            if len(window) == length and tokenizer.encode(text) == window:
                prompts.append(Prompt(text, tuple(window)))
                break
        else:
            raise BenchmarkError(f"cannot build a prompt of exactly {length} tokens")
    return prompts


def kv_cache_bytes_for(folder: Path, dtype: str, sequences: int, tokens: int) -> int:
    """A KV-cache budget that holds ``sequences`` sequences of ``tokens`` tokens at once (and
    never less than the engine default), so no system waits for memory.

    Raises:
        BenchmarkError: ``config.json`` of ``folder`` is missing or lacks the model's shape.
    """
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        heads = int(config["num_attention_heads"])
        per_block = bytes_per_block(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            block_size=_KV_BLOCK_SIZE,
            dtype_bytes=torch.finfo(_TORCH_DTYPES[dtype]).bits // 8,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchmarkError(
            f"cannot size the KV cache from {folder / 'config.json'}: {exc}"
        ) from exc
    # One spare block per sequence: the engine may allocate the next block a token early.
    blocks = sequences * (math.ceil(tokens / _KV_BLOCK_SIZE) + 1)
    return max(DEFAULT_KV_CACHE_BYTES, blocks * per_block)


# --------------------------------------------------------------------------- measurements


@dataclass
class Measurement:
    """One timed run of one system: N requests, or the first few of them (transformers)."""

    system: str
    requests: int  # requests the configuration asks for (N)
    timed_requests: int  # requests actually run and timed
    tokens: int  # tokens the system actually generated (counted)
    expected_tokens: int  # timed_requests * new_tokens
    seconds: float
    ttft_ms: float | None = None  # median time to first token over the timed requests
    itl_ms: float | None = None  # median gap between consecutive tokens
    forwards: int | None = None  # engine forwards it took (our engine's systems only)
    engine_seconds: float | None = None  # time spent inside those forwards
    foreign_cores: float | None = None  # cores other processes kept busy meanwhile (average)

    @property
    def engine_busy(self) -> float | None:
        """Fraction of the wall time the engine spent in forwards (None when not known)."""
        return None if self.engine_seconds is None else self.engine_seconds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.tokens / self.seconds

    def to_json(self) -> dict[str, Any]:
        """The measurement as a JSON-ready dict."""
        return {
            "tokens": self.tokens,
            "expected_tokens": self.expected_tokens,
            "timed_requests": self.timed_requests,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            "itl_ms": None if self.itl_ms is None else round(self.itl_ms, 3),
            "forwards": self.forwards,
            "engine_seconds": None
            if self.engine_seconds is None
            else round(self.engine_seconds, 4),
            "engine_busy": None if self.engine_busy is None else round(self.engine_busy, 4),
            "foreign_cores": None if self.foreign_cores is None else round(self.foreign_cores, 3),
        }


class _CountingEngine:
    """Passes every call through to the runtime's engine and counts the tokens it samples per
    request, so the runtime's throughput uses generated tokens, not requested ones (its
    outputs are text deltas, which need not be one per token). Also counts forwards and the
    time spent in them: wall time minus that is what the runtime adds around the engine."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.tokens: Counter[str] = Counter()
        self._ahead: dict[str, Step] = {}  # per request, its latest step run ahead with a token
        self.forwards = 0
        self.seconds = 0.0

    def cost(self, step: Step) -> int:
        return self.inner.cost(step)

    def forward(self, steps: Sequence[Step]) -> list[StepResult]:
        started = time.perf_counter()
        results = self.inner.forward(steps)
        self.seconds += time.perf_counter() - started
        self.forwards += 1
        for step, result in zip(steps, results, strict=True):
            if isinstance(result, dict) and "token" in result:
                self.tokens[step.request_id] += 1
                if step.ahead:
                    self._ahead[step.request_id] = step
        return results

    def release(self, request_id: str) -> None:
        self._ahead.pop(request_id, None)
        self.inner.release(request_id)

    def __getattr__(self, name: str) -> Any:
        # Anything else an engine may offer (e.g. export_state) is the wrapped engine's.
        if name == "discard":
            return self._discard_counted(getattr(self.inner, name))
        return getattr(self.inner, name)

    def _discard_counted(self, discard: Callable[[Step], None]) -> Callable[[Step], None]:
        # A decode step run ahead of a loop that then stopped is undone: its token was never
        # generated.
        def counted(step: Step) -> None:
            discard(step)
            if self._ahead.get(step.request_id) is step:
                del self._ahead[step.request_id]
                self.tokens[step.request_id] -= 1

        return counted


@dataclass
class _Requests:
    """What the client saw of N concurrent requests: when they were submitted, when each
    ``TextDelta`` arrived, and the ``completion_tokens`` each request's program reported."""

    started: float
    stamps: list[list[float]]
    completion_tokens: list[int | None]

    def measurement(
        self,
        system: str,
        tokens: int,
        new_tokens: int,
        forwards: int | None = None,
        engine_seconds: float | None = None,
    ) -> Measurement:
        """A measurement of ``tokens`` generated, timed from the first submit to the last
        text output, with the requests' median TTFT and ITL."""
        stamps = self.stamps
        finished = max((s[-1] for s in stamps if s), default=time.perf_counter())
        gaps = [b - a for s in stamps for a, b in itertools.pairwise(s)]
        first = [s[0] - self.started for s in stamps if s]
        return Measurement(
            system,
            requests=len(stamps),
            timed_requests=len(stamps),
            tokens=tokens,
            expected_tokens=len(stamps) * new_tokens,
            seconds=finished - self.started,
            ttft_ms=None if not first else 1000 * summarize(first).median,
            itl_ms=None if not gaps else 1000 * summarize(gaps).median,
            forwards=forwards,
            engine_seconds=engine_seconds,
        )


async def _run_requests(
    runtime: Runtime, ids: Sequence[str], prompts: Sequence[Prompt], new_tokens: int
) -> _Requests:
    """Run one request per prompt at once, each from its own task, and read every output.

    Raises:
        RequestError: a request failed.
    """
    requests = _Requests(0.0, [[] for _ in prompts], [None] * len(prompts))

    async def one(index: int) -> None:
        async with runtime.generate(
            request_id=ids[index],
            prompt=prompts[index].text,
            max_tokens=new_tokens,
            temperature=0.0,
            chat=False,
            ignore_eos=True,
        ) as outputs:
            async for item in outputs:
                if isinstance(item, TextDelta):  # not the closing TextEnd
                    requests.stamps[index].append(time.perf_counter())
        requests.completion_tokens[index] = outputs.metrics.completion_tokens

    requests.started = time.perf_counter()
    async with anyio.create_task_group() as tasks:
        for index in range(len(prompts)):
            tasks.start_soon(one, index)
    return requests


class RuntimeSystem:
    """``causal-lm`` served by an open runtime; requests come from concurrent tasks."""

    name = "runtime"

    def __init__(self, runtime: Runtime) -> None:
        """Wrap the runtime's engine in a counter.

        Raises:
            BenchmarkError: the runtime has not exactly one engine in this process.
        """
        self.runtime = runtime
        engines = runtime.batching.engines
        if len(engines) != 1:
            raise BenchmarkError(f"causal-lm should have one engine, got {sorted(engines)}")
        self.engine_name = next(iter(engines))
        self.counter = _CountingEngine(engines[self.engine_name])
        # Swapped in before any request runs: the batching loop looks engines up per forward.
        engines[self.engine_name] = self.counter
        self._serial = 0

    async def measure(self, prompts: Sequence[Prompt], new_tokens: int) -> Measurement:
        """Run one request per prompt at once; tokens are those the engine sampled.

        Raises:
            RequestError: a request failed.
        """
        self._serial += 1
        ids = [f"runtime-{self._serial}-{i}" for i in range(len(prompts))]
        self.counter.forwards, self.counter.seconds = 0, 0.0
        requests = await _run_requests(self.runtime, ids, prompts, new_tokens)
        tokens = sum(self.counter.tokens.pop(rid, 0) for rid in ids)
        return requests.measurement(
            self.name, tokens, new_tokens, self.counter.forwards, self.counter.seconds
        )


class _OneWorkerSystem:
    """``causal-lm`` served by a runtime whose engine runs in one worker process; requests
    come from concurrent tasks of this process, which runs the conductor."""

    name = "one-worker"

    def __init__(self, runtime: Runtime) -> None:
        """Serve requests through ``runtime``.

        Raises:
            BenchmarkError: the runtime does not run its engine in exactly one worker process.
        """
        if runtime.pool is None or len(runtime.pool.ranks) != 1:
            raise BenchmarkError("the one-worker system needs a runtime with one worker rank")
        self.runtime = runtime
        self.pool = runtime.pool
        self._serial = 0

    def worker_pids(self) -> list[int]:
        """The worker process's id (none while it restarts), for CPU accounting."""
        pids = (self.pool.pid(rank) for rank in self.pool.ranks)
        return [pid for pid in pids if pid is not None]

    async def measure(self, prompts: Sequence[Prompt], new_tokens: int) -> Measurement:
        """Run one request per prompt at once; tokens are the ``completion_tokens`` each
        request's program reported (a request that reported none counts 0).

        Raises:
            RequestError: a request failed (e.g. its worker died).
        """
        self._serial += 1
        ids = [f"one-worker-{self._serial}-{i}" for i in range(len(prompts))]
        requests = await _run_requests(self.runtime, ids, prompts, new_tokens)
        tokens = sum(count or 0 for count in requests.completion_tokens)
        return requests.measurement(self.name, tokens, new_tokens)


class _ThreadsLauncher:
    """Starts each worker as ``LocalLauncher`` does (a child process over IPC), with
    ``threads`` torch threads: ``open_runtime`` takes no thread count, and its ``WorkerPool``
    would give a lone worker only the cores left after counting this process as a
    participant (1 of 2), not the count torch has in this process."""

    curve_keys: CurveKeys | None = None  # IPC: no TCP to secure

    def __init__(self, threads: int) -> None:
        self.inner = LocalLauncher()
        self.threads = threads

    async def open(self) -> str | None:
        """``LocalLauncher.open``: None (IPC). Never raises."""
        return await self.inner.open()

    async def start(self, config: WorkerConfig) -> WorkerHandle:
        """Start the worker ``config`` describes, with ``threads`` torch threads.

        Raises:
            OSError: the process could not be started.
        """
        return await self.inner.start(replace(config, threads=self.threads))

    async def aclose(self) -> None:
        """``LocalLauncher.aclose``. Never raises."""
        await self.inner.aclose()


class _HandLoopSystem:
    """Our engine driven by a plain loop: every request's prefill in one forward, then one
    forward per decode round for all requests together."""

    name = "handloop"

    def __init__(self, engine: KVCacheEngine) -> None:
        self.engine = engine
        self._serial = 0

    def measure(self, prompts: Sequence[Prompt], new_tokens: int) -> Measurement:
        self._serial += 1
        ids = [f"handloop-{self._serial}-{i}" for i in range(len(prompts))]
        sampling = SamplingParams(
            temperature=0.0, max_tokens=new_tokens, stop_token_ids=frozenset()
        )
        tensors = [torch.tensor(p.ids, dtype=torch.long) for p in prompts]
        started = time.perf_counter()
        results = self.engine.forward(
            [
                Step(rid, "prefill", {"tokens": t, "sampling": sampling})
                for rid, t in zip(ids, tensors, strict=True)
            ]
        )
        first_token = time.perf_counter()
        last = _tokens_of(results, "prefill")
        tokens = len(last)
        rounds: list[float] = []
        for _ in range(new_tokens - 1):
            steps = [Step(rid, "decode", {"token": t}) for rid, t in zip(ids, last, strict=True)]
            before = time.perf_counter()
            results = self.engine.forward(steps)
            rounds.append(time.perf_counter() - before)
            last = _tokens_of(results, "decode")
            tokens += len(last)
        finished = time.perf_counter()
        for rid in ids:
            self.engine.release(rid)
        return Measurement(
            self.name,
            requests=len(prompts),
            timed_requests=len(prompts),
            tokens=tokens,
            expected_tokens=len(prompts) * new_tokens,
            seconds=finished - started,
            ttft_ms=1000 * (first_token - started),
            itl_ms=None if not rounds else 1000 * summarize(rounds).median,
            forwards=1 + len(rounds),
            engine_seconds=(first_token - started) + sum(rounds),
        )


def _tokens_of(results: Sequence[StepResult], op: str) -> list[torch.Tensor]:
    # Every step must finish in its forward (no budget is set, and the KV cache is sized to
    # hold everything): anything else means the loop would silently lose tokens.
    tokens: list[torch.Tensor] = []
    for result in results:
        if not isinstance(result, dict) or "token" not in result:
            raise BenchmarkError(f"hand loop: a {op} step returned {result!r}, not a token")
        tokens.append(result["token"])
    return tokens


def transformers_model(folder: Path, dtype: torch.dtype) -> Any:
    """The checkpoint as ``AutoModelForCausalLM``, in eval mode.

    Raises:
        BenchmarkError: transformers is not installed.
    """
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise BenchmarkError(
            "the transformers baseline needs transformers: pip install -e '.[test]'"
        ) from exc
    # transformers is only partly typed: hold its objects as Any.
    loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return loaded.eval()


class TransformersSystem:
    """``transformers`` greedy ``generate``: one request after another, or (``static``) the
    N prompts as one batch."""

    def __init__(self, model: Any, eos_token_ids: Sequence[int], *, static: bool) -> None:
        self.model = model
        self.eos = sorted(eos_token_ids)
        self.static = static
        self.name = "transformers-static" if static else "transformers"

    def _generation_config(self, new_tokens: int) -> Any:
        from transformers import GenerationConfig

        # A fresh config rather than the checkpoint's: greedy only, so no sampling defaults for
        # transformers to warn about. min_new_tokens = max_new_tokens suppresses EOS until the
        # last token, as ignore_eos does for the runtime; padding uses an EOS id, as usual.
        make: Any = GenerationConfig
        return make(
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=self.eos or None,
            pad_token_id=self.eos[0] if self.eos else 0,
        )

    def measure(
        self, prompts: Sequence[Prompt], new_tokens: int, timed: int | None = None
    ) -> Measurement:
        """Generate ``new_tokens`` for the first ``timed`` prompts one by one (all of them
        when ``None``), or for every prompt in one batch (``static``); never raises on its
        own (a wrong token count is ``check_tokens``'s to find)."""
        count = len(prompts) if timed is None or self.static else min(timed, len(prompts))
        config = self._generation_config(new_tokens)
        rows = [p.ids for p in prompts[:count]]
        # The prompts all have the same length, so a static batch needs no padding.
        batches = [rows] if self.static else [[row] for row in rows]
        inputs = [torch.tensor(batch, dtype=torch.long) for batch in batches]
        tokens = 0
        started = time.perf_counter()
        for ids in inputs:
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            tokens += (int(out.shape[1]) - int(ids.shape[1])) * int(ids.shape[0])
        finished = time.perf_counter()
        return Measurement(
            self.name,
            requests=len(prompts),
            timed_requests=count,
            tokens=tokens,
            expected_tokens=count * new_tokens,
            seconds=finished - started,
        )


# --------------------------------------------------------------------------- the run


@dataclass
class _Configuration:
    """The measurements of one (dtype, concurrency), repetition by repetition."""

    dtype: str
    concurrency: int
    rounds: list[dict[str, Measurement]] = field(default_factory=list)
    discarded: int = 0  # contaminated repetitions measured again
    limit: float = math.inf  # max_foreign_cores of the run

    def contaminated(self) -> int:
        """Repetitions kept although another process competed for the CPUs during them."""
        return sum(contamination(r) > self.limit for r in self.rounds)

    def to_json(self) -> dict[str, Any]:
        systems: dict[str, Any] = {}
        for name in SYSTEMS:
            runs = [r[name] for r in self.rounds]
            ttft = [m.ttft_ms for m in runs if m.ttft_ms is not None]
            itl = [m.itl_ms for m in runs if m.itl_ms is not None]
            busy = [m.engine_busy for m in runs if m.engine_busy is not None]
            systems[name] = {
                "tokens_per_s": summarize([m.tokens_per_s for m in runs]).to_json(),
                "ttft_ms_p50": summarize(ttft).to_json() if ttft else None,
                "itl_ms_p50": summarize(itl).to_json() if itl else None,
                "engine_busy": summarize(busy).to_json() if busy else None,
                "forwards": runs[0].forwards,
                "requests": self.concurrency,
                "timed_requests": runs[0].timed_requests,
                "extrapolated": runs[0].timed_requests < self.concurrency,
                "repetitions": [m.to_json() for m in runs],
            }
        per_round = [{n: m.tokens_per_s for n, m in r.items()} for r in self.rounds]
        ratios = ratio_table(per_round, RATIOS)
        return {
            "dtype": self.dtype,
            "concurrency": self.concurrency,
            "systems": systems,
            "ratios": {key: s.to_json() for key, s in ratios.items()},
            "discarded_repetitions": self.discarded,
            "contaminated_repetitions": self.contaminated(),
        }


#: Measurements shorter than this are not judged for contamination: CPU clocks tick every
#: 10 ms, so over a short window one tick reads as a large fraction of a core.
_JUDGED_SECONDS = 1.0


def contamination(measured: dict[str, Measurement]) -> float:
    """The most cores other processes used during any (long enough) measurement of a
    repetition."""
    return max(
        (m.foreign_cores or 0.0 for m in measured.values() if m.seconds >= _JUDGED_SECONDS),
        default=0.0,
    )


def check_tokens(measurement: Measurement) -> Measurement:
    """Return ``measurement`` if its system generated exactly the tokens it was asked for.

    Raises:
        BenchmarkError: it generated more or fewer (its tokens/s would be wrong).
    """
    if measurement.tokens != measurement.expected_tokens:
        raise BenchmarkError(
            f"{measurement.system} generated {measurement.tokens} tokens for "
            f"{measurement.timed_requests} requests, expected {measurement.expected_tokens}: "
            "its throughput would be wrong"
        )
    return measurement


_System = RuntimeSystem | _OneWorkerSystem | _HandLoopSystem | TransformersSystem


async def measure(
    system: _System,
    prompts: Sequence[Prompt],
    new_tokens: int,
    transformers_requests: int | None,
) -> Measurement:
    """One measurement of ``system``, with the cores other processes used meanwhile.

    Raises:
        BenchmarkError: the system generated the wrong number of tokens.
        RequestError: a runtime request failed.
    """
    # Collect garbage first so a collection of the previous run's objects is not timed here.
    gc.collect()
    # The one-worker system's worker process computes for it: its CPU time is not foreign.
    children = system.worker_pids() if isinstance(system, _OneWorkerSystem) else []
    before: CpuSample = cpu_sample(children)
    if isinstance(system, RuntimeSystem | _OneWorkerSystem):
        measurement = await system.measure(prompts, new_tokens)
    elif isinstance(system, TransformersSystem):
        # The baselines compute on a worker thread, as the runtime's engine does, so every
        # system runs under the same conditions (thread, OpenMP team, allocator arena).
        run = functools.partial(system.measure, prompts, new_tokens, transformers_requests)
        measurement = await anyio.to_thread.run_sync(run)
    else:
        measurement = await anyio.to_thread.run_sync(system.measure, prompts, new_tokens)
    measurement.foreign_cores = foreign_cores(before, cpu_sample(children))
    return check_tokens(measurement)


async def _repetition(
    config: DecodeConfig,
    systems: dict[str, _System],
    prompts: Sequence[Prompt],
    order: Sequence[str],
    label: str,
    progress: Progress,
) -> dict[str, Measurement]:
    """Measure every system once, in ``order``.

    Raises:
        BenchmarkError: a system generated the wrong number of tokens.
        RequestError: a runtime request failed.
    """
    measured: dict[str, Measurement] = {}
    for name in order:
        m = await measure(systems[name], prompts, config.new_tokens, config.transformers_requests)
        measured[name] = m
        others = "" if m.foreign_cores is None else f"; other processes {m.foreign_cores:.2f} cores"
        progress(
            f"{label}: {name} {m.tokens_per_s:.1f} tok/s "
            f"({m.tokens} tokens in {m.seconds:.2f} s{others})"
        )
    return measured


@asynccontextmanager
async def _open_systems(
    config: DecodeConfig, folder: Path, dtype: str, threads: int, progress: Progress
) -> AsyncIterator[dict[str, _System]]:
    """Every system for ``dtype``, both runtimes open until the block exits; the one-worker
    runtime's worker runs ``threads`` torch threads.

    Raises:
        BenchmarkError: the KV cache cannot be sized, or a runtime has an unexpected shape.
        CheckpointError: the checkpoint folder is unusable.
        PlacementError, WorkerLost: the one-worker runtime failed to start.
    """
    tokenizer = ChatTokenizer.from_folder(folder)
    kv_bytes = kv_cache_bytes_for(
        folder, dtype, max(config.concurrency), config.prompt_tokens + config.new_tokens
    )
    progress(f"{dtype}: loading transformers model")
    reference = transformers_model(folder, _TORCH_DTYPES[dtype])
    eos = sorted(tokenizer.eos_token_ids)
    progress(f"{dtype}: building the hand-loop engine")
    # Built on a worker thread, exactly as open_runtime builds the runtime's engine.
    build = functools.partial(
        build_lm_engine,
        folder,
        dtype=_TORCH_DTYPES[dtype],
        kv_cache_bytes=kv_bytes,
        device="cpu",
        compile=False,
    )
    hand = _HandLoopSystem(await anyio.to_thread.run_sync(build))
    async with AsyncExitStack() as stack:
        progress(f"{dtype}: opening the runtime")
        model = build_causal_lm(folder, dtype=dtype, kv_cache_bytes=kv_bytes)
        runtime = await stack.enter_async_context(open_runtime(model))
        progress(f"{dtype}: opening the runtime with one worker process ({threads} threads)")
        # From the zoo, so the worker process can rebuild the same model from its source.
        remote = build_model("causal-lm", path=str(folder), dtype=dtype, kv_cache_bytes=kv_bytes)
        worker = await stack.enter_async_context(
            open_runtime(remote, placement=Placement.single(), launcher=_ThreadsLauncher(threads))
        )
        yield {
            "one-worker": _OneWorkerSystem(worker),
            "runtime": RuntimeSystem(runtime),
            "handloop": hand,
            "transformers": TransformersSystem(reference, eos, static=False),
            "transformers-static": TransformersSystem(reference, eos, static=True),
        }


async def _warm_up(
    config: DecodeConfig,
    systems: dict[str, _System],
    prompts: Sequence[Prompt],
    dtype: str,
    progress: Progress,
) -> None:
    """Run every system at every concurrency (transformers: once) on short requests.

    Raises:
        BenchmarkError: a system generated the wrong number of tokens.
        RequestError: a runtime request failed.
    """
    warm = min(config.warmup_tokens, config.new_tokens)
    for name, system in systems.items():
        progress(f"{dtype}: warming up {name}")
        # The transformers baseline runs one request at a time: one warm-up is enough.
        levels = (1,) if name == "transformers" else config.concurrency
        for n in levels:
            await measure(system, prompts[:n], warm, None)


async def _run_concurrency(
    config: DecodeConfig,
    systems: dict[str, _System],
    prompts: Sequence[Prompt],
    dtype: str,
    progress: Progress,
) -> _Configuration:
    """Every repetition of every system at N = ``len(prompts)``, contaminated repetitions
    measured again up to ``config.retries`` times.

    Raises:
        BenchmarkError: a system generated the wrong number of tokens.
        RequestError: a runtime request failed.
    """
    n = len(prompts)
    entry = _Configuration(dtype, n, limit=config.max_foreign_cores)
    for rep in range(config.repeat):
        order = SYSTEMS if rep % 2 == 0 else tuple(reversed(SYSTEMS))
        label = f"{dtype} N={n} repetition {rep + 1}/{config.repeat}"
        for attempt in range(config.retries + 1):
            measured = await _repetition(config, systems, prompts, order, label, progress)
            load = contamination(measured)
            if load <= config.max_foreign_cores or attempt == config.retries:
                break
            # Another process competed for the 2 cores: these figures say more about it than
            # about us, so the whole repetition (all systems) runs again.
            entry.discarded += 1
            progress(
                f"{label}: other processes used up to {load:.2f} cores "
                f"(> {config.max_foreign_cores}); measuring it again"
            )
        entry.rounds.append(measured)
    return entry


async def _run_dtype(
    config: DecodeConfig,
    folder: Path,
    dtype: str,
    prompts: list[Prompt],
    threads: int,
    progress: Progress,
) -> list[_Configuration]:
    """Every configuration of ``dtype``.

    Raises:
        BenchmarkError: a system generated the wrong number of tokens, or the KV cache cannot
            be sized.
        CheckpointError: the checkpoint folder is unusable.
        PlacementError, WorkerLost: the one-worker runtime failed to start.
        RequestError: a runtime request failed.
    """
    configurations: list[_Configuration] = []
    async with _open_systems(config, folder, dtype, threads, progress) as systems:
        await _warm_up(config, systems, prompts, dtype, progress)
        for n in config.concurrency:
            configurations.append(
                await _run_concurrency(config, systems, prompts[:n], dtype, progress)
            )
    del systems  # the engines and models, before the next dtype loads its own
    gc.collect()
    return configurations


def _aims(configurations: Sequence[dict[str, Any]], dtypes: Sequence[str]) -> list[dict[str, Any]]:
    found = {(c["dtype"], c["concurrency"]): c for c in configurations}
    aims: list[dict[str, Any]] = []
    for dtype in dtypes:
        for goal in AIMS:
            entry = found.get((dtype, goal.concurrency))
            measured = None if entry is None else entry["ratios"][goal.ratio]["median"]
            aims.append(
                aim_entry(
                    f"{dtype}: {goal.describe()}",
                    goal.target,
                    measured,
                    dtype=dtype,
                    concurrency=goal.concurrency,
                    ratio=goal.ratio,
                )
            )
    return aims


def _systems(timed: int | None, threads: int) -> list[dict[str, Any]]:
    """The five systems, with the torch threads of the process that runs each one's forwards
    (``one-worker``: its worker rank; its conductor runs in this process, with ``threads``)."""
    descriptions = {
        "one-worker": (
            "causal-lm via open_runtime(placement=Placement.single()): engine and batching "
            "loop in one worker process (IPC), conductor and N concurrent "
            "runtime.generate tasks here; tokens are the requests' completion_tokens"
        ),
        "runtime": "causal-lm via open_runtime, N concurrent runtime.generate tasks",
        "handloop": "KVCacheEngine.forward in a plain loop: N prefills, then N decodes/round",
        "transformers": (
            "AutoModelForCausalLM.generate, greedy, one request after another"
            + ("" if timed is None else f" (at most {timed} timed per repetition)")
        ),
        "transformers-static": (
            "AutoModelForCausalLM.generate, greedy, the N prompts as one static batch"
        ),
    }
    entries = [system_entry(name, descriptions[name], torch_threads=threads) for name in SYSTEMS]
    entries[SYSTEMS.index("one-worker")]["conductor_torch_threads"] = threads
    return entries


async def run_decode(config: DecodeConfig, progress: Progress = quiet) -> dict[str, Any]:
    """Run the decode benchmark and return its report (a JSON-ready dict).

    The report has the shape of ``mstar_async.bench.report``: ``workload`` names the model
    folder; each of ``systems`` has the torch threads of the process that runs its forwards
    (``torch_threads``; ``one-worker`` also ``conductor_torch_threads``, this process's, which
    runs its conductor); ``results`` has one entry per dtype and concurrency (per-system
    tokens/s, TTFT and ITL summaries, per-repetition measurements, and the ratios); ``aims``
    has every aim of ``AIMS`` for every dtype.

    Raises:
        BenchmarkError: a system generated the wrong number of tokens, or no prompt of the
            requested length can be built.
        CheckpointError: the checkpoint folder is unusable.
        PlacementError, WorkerLost: the one-worker runtime failed to start.
        RequestError: a runtime request failed.
    """
    started = time.perf_counter()
    folder = config.folder if config.folder is not None else smollm2_folder(progress=progress)
    progress(f"model: {folder}")
    tokenizer = ChatTokenizer.from_folder(folder)
    prompts = build_prompts(tokenizer, max(config.concurrency), config.prompt_tokens)
    machine = machine_info()
    # The in-process systems compute with torch's thread count of this process; the worker
    # rank gets the same count, so every system's forwards run on as many threads.
    threads = torch.get_num_threads()
    configurations: list[_Configuration] = []
    for dtype in config.dtypes:
        configurations.extend(await _run_dtype(config, folder, dtype, prompts, threads, progress))
    results = [c.to_json() for c in configurations]
    machine["load_average_end"] = machine_info()["load_average"]
    timed = config.transformers_requests
    return make_report(
        "decode",
        workload={
            "model": str(folder),
            "mode": config.mode,
            "dtypes": list(config.dtypes),
            "concurrency": list(config.concurrency),
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "repeat": config.repeat,
            "transformers_requests": timed,
            "max_foreign_cores": config.max_foreign_cores,
            "retries": config.retries,
            "greedy": True,
            "ignore_eos": True,
        },
        machine=machine,
        systems=_systems(timed, threads),
        results=results,
        aims=_aims(results, config.dtypes),
        seconds=time.perf_counter() - started,
    )


def run_decode_sync(config: DecodeConfig, progress: Progress | None = None) -> dict[str, Any]:
    """``run_decode`` on a fresh event loop (uvloop when installed); progress on stderr by
    default.

    Raises:
        As ``run_decode``.
    """
    log: Progress = progress if progress is not None else ProgressLog()
    report: dict[str, Any] = run_async(run_decode, config, log)
    return report


# --------------------------------------------------------------------------- text report


def _cell(summary: dict[str, Any] | None, digits: int = 1, suffix: str = "") -> str:
    if summary is None:
        return "-"
    median, low, high = summary["median"], summary["min"], summary["max"]
    if summary["n"] == 1:
        return f"{median:.{digits}f}{suffix}"
    return f"{median:.{digits}f}{suffix} [{low:.{digits}f}-{high:.{digits}f}]"


def _percent(summary: dict[str, Any] | None) -> str:
    return "-" if summary is None else f"{100 * summary['median']:.0f}%"


_HEADER = (
    f"{'N':>4} | {'runtime tok/s':>22} | {'one-worker tok/s':>22} | "
    f"{'transformers tok/s':>22} | {'static batch tok/s':>22} | {'handloop tok/s':>22} | "
    f"{'runtime/transformers':>22} | {'runtime/static':>20} | {'runtime/handloop':>20} | "
    f"{'one-worker/runtime':>20} | {'rt TTFT p50 ms':>14} | "
    f"{'rt ITL p50 ms':>13} | {'1w ITL p50 ms':>13} | {'rt busy':>7}"
)


def _row(entry: dict[str, Any]) -> str:
    """One concurrency's line of a dtype's table."""
    systems, ratios = entry["systems"], entry["ratios"]
    runtime, worker = systems["runtime"], systems["one-worker"]
    return (
        f"{entry['concurrency']:>4} | {_cell(runtime['tokens_per_s']):>22} | "
        f"{_cell(worker['tokens_per_s']):>22} | "
        f"{_cell(systems['transformers']['tokens_per_s']):>22} | "
        f"{_cell(systems['transformers-static']['tokens_per_s']):>22} | "
        f"{_cell(systems['handloop']['tokens_per_s']):>22} | "
        f"{_cell(ratios['runtime/transformers'], 2, 'x'):>22} | "
        f"{_cell(ratios['runtime/transformers-static'], 2, 'x'):>20} | "
        f"{_cell(ratios['runtime/handloop'], 2, 'x'):>20} | "
        f"{_cell(ratios['one-worker/runtime'], 2, 'x'):>20} | "
        f"{_cell(runtime['ttft_ms_p50'], 0):>14} | {_cell(runtime['itl_ms_p50'], 1):>13} | "
        f"{_cell(worker['itl_ms_p50'], 1):>13} | {_percent(runtime['engine_busy']):>7}"
    )


def _threads_line(report: dict[str, Any]) -> str:
    """Which torch thread counts each system ran with, and how the processes share the CPUs."""
    systems = {entry["name"]: entry for entry in report["systems"]}
    threads = {name: entry["torch_threads"] for name, entry in systems.items()}
    return (
        f"torch threads: runtime {threads['runtime']}, handloop {threads['handloop']}, "
        f"transformers {threads['transformers']}, transformers-static "
        f"{threads['transformers-static']} (all in this process); one-worker "
        f"{threads['one-worker']} in its worker process, while this process runs its conductor "
        f"with {systems['one-worker']['conductor_torch_threads']} (the two processes share the "
        f"{report['machine']['cpu_count']} CPUs)"
    )


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the thread counts, a table per dtype, notes on extrapolation and
    contamination, and the aims."""
    work = report["workload"]
    machine = report["machine"]
    lines = [
        f"decode benchmark: {Path(work['model']).name}, {work['prompt_tokens']}-token prompts, "
        f"{work['new_tokens']} new tokens, greedy, EOS ignored ({work['mode']} mode)",
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, torch "
        f"{machine['torch_version']} ({machine['torch_threads']} threads), transformers "
        f"{machine['transformers_version']}, load average {machine['load_average']}",
        f"each cell: median of {work['repeat']} repetitions [min-max]; systems interleaved; "
        "ratios taken within each repetition; rt: the in-process runtime, 1w: the one-worker "
        "runtime; rt busy: share of the runtime's wall time spent inside engine forwards",
        f"a repetition during which other processes kept more than {work['max_foreign_cores']} "
        f"cores busy is measured again (up to {work['retries']} times)",
        _threads_line(report),
    ]
    notes: list[str] = []
    for dtype in work["dtypes"]:
        lines += ["", dtype, _HEADER, "-" * len(_HEADER)]
        for entry in report["results"]:
            if entry["dtype"] != dtype:
                continue
            systems = entry["systems"]
            lines.append(_row(entry))
            where = f"{dtype} N={entry['concurrency']}"
            if entry["discarded_repetitions"]:
                notes.append(
                    f"{where}: {entry['discarded_repetitions']} repetition(s) measured again "
                    "because other processes competed for the CPUs"
                )
            if entry["contaminated_repetitions"]:
                notes.append(
                    f"{where}: {entry['contaminated_repetitions']} repetition(s) kept although "
                    f"other processes used more than {work['max_foreign_cores']} cores during "
                    "them (no retries left): treat this row with suspicion"
                )
            tf = systems["transformers"]
            if tf["extrapolated"]:
                notes.append(
                    f"{where}: transformers timed on "
                    f"{tf['timed_requests']} of {tf['requests']} sequential requests per "
                    "repetition; tokens/s is their rate, extrapolated to all "
                    f"{tf['requests']} (use --full to time every request)"
                )
    if notes:
        lines += ["", *notes]
    lines += ["", "aims:"]
    for entry in report["aims"]:
        if entry["met"] is None:
            verdict = f"not measured (N={entry['concurrency']} not in this run)"
        else:
            verdict = f"{entry['measured']:.2f}x: {'met' if entry['met'] else 'NOT met'}"
        lines.append(f"  {entry['name']}: {verdict}")
    lines.append(f"\ntotal {report['seconds']} s")
    return "\n".join(lines)


def configure(base: DecodeConfig, **overrides: Any) -> DecodeConfig:
    """``base`` with the ``overrides`` that are not None (command-line options left unset)."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
