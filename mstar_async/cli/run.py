"""``mstar run MODEL [--input value ...]``: one request, its outputs summarised, with timings.

Any ``--name value`` after the model becomes the request input ``name`` (dashes become
underscores), converted to the type of that input's default in the model's program.
``-o/--output PATH`` saves what the request produced; the writer is chosen by the file's
extension from ``OUTPUT_WRITERS`` (audio: .wav, .flac, .ogg, .mp3, .opus, .pcm, .raw, .f32),
so a new kind of output registers its extensions there with ``register_output_writer``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar_async.audio import EXTENSIONS as AUDIO_EXTENSIONS
from mstar_async.audio import write_audio
from mstar_async.errors import MstarError
from mstar_async.graph import Model
from mstar_async.models import build_model
from mstar_async.outputs import ActionOutput, AudioChunk, ImageOutput, LatentOutput, TextDelta
from mstar_async.placement import Placement
from mstar_async.worker.launchers import Launcher
from mstar_async.worker.remote import RemoteLauncher


def add_run_parser(sub: Any) -> None:
    """Add ``run`` to the ``mstar`` subcommands."""
    run = sub.add_parser(
        "run",
        help="run one request on a model and print what it produced",
        description="Run one request. Extra --name value options become the program's inputs.",
    )
    run.add_argument("model", help="a model name from 'mstar models'")
    run.add_argument("--json", action="store_true", help="print a JSON summary")
    run.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help=f"save the outputs; the extension picks the format ({', '.join(OUTPUT_WRITERS)})",
    )
    run.add_argument(
        "--placement",
        type=Path,
        metavar="FILE",
        help="a placement YAML: run its ranks as worker processes (default: all in this one)",
    )
    run.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        help=(
            "with --placement: ranks whose hosts: entry is another host join here over TCP "
            "(run 'mstar worker --conductor tcp://THIS_HOST:PORT --rank N' on each)"
        ),
    )
    run.add_argument(
        "--join",
        metavar="RANKS",
        help=(
            "with --listen: the ranks that join over TCP, comma-separated (default: those "
            "hosts: puts on other hosts); e.g. 0,1 to try it all on one host"
        ),
    )
    run.set_defaults(handler=_run)


def parse_inputs(model: Model, extra: list[str]) -> dict[str, Any]:
    """Turn ``--name value`` pairs into program inputs typed like the program's defaults.

    Raises:
        MstarError: an option is malformed or names no input of the program.
    """
    params = dict(inspect.signature(model.program).parameters)
    params.pop(next(iter(params)))  # the request context
    inputs: dict[str, Any] = {}
    tokens = list(extra)
    while tokens:
        flag = tokens.pop(0)
        if not flag.startswith("--") or not tokens:
            raise MstarError(f"expected '--name value' pairs after the model, got {flag!r}")
        name, raw = flag[2:].replace("-", "_"), tokens.pop(0)
        if name not in params:
            raise MstarError(
                f"model {model.name!r} takes no input --{flag[2:]}; inputs: {sorted(params)}"
            )
        default = params[name].default
        kind = (
            type(default) if default is not inspect.Parameter.empty and default is not None else str
        )
        inputs[name] = (raw.lower() in ("1", "true", "yes")) if kind is bool else kind(raw)
    return inputs


OutputWriter = Callable[[Path, Sequence[Any]], str]
"""Saves a request's outputs (all of them, in order) to a path; returns a line saying what."""

OUTPUT_WRITERS: dict[str, OutputWriter] = {}


def register_output_writer(extensions: Iterable[str], writer: OutputWriter) -> None:
    """Make ``-o`` save files with these extensions (".wav", ...) through ``writer``."""
    for extension in extensions:
        OUTPUT_WRITERS[extension.lower()] = writer


def _write_audio_output(path: Path, outputs: Sequence[Any]) -> str:
    chunks = [o for o in outputs if isinstance(o, AudioChunk)]
    if not chunks:
        raise MstarError(f"the request produced no audio to save in {path}")
    samples = write_audio(path, chunks)
    return f"wrote {path}: {samples} samples at {chunks[0].sample_rate} Hz"


def _write_image_output(path: Path, outputs: Sequence[Any]) -> str:
    from mstar_async.cli.images import write_images

    return write_images(path, [o for o in outputs if isinstance(o, ImageOutput)])


register_output_writer(AUDIO_EXTENSIONS, _write_audio_output)
register_output_writer([".png"], _write_image_output)


def output_writer(path: str | Path) -> OutputWriter:
    """The writer for ``path``'s extension.

    Raises:
        MstarError: no writer takes that extension (the message lists those that exist).
    """
    writer = OUTPUT_WRITERS.get(Path(path).suffix.lower())
    if writer is None:
        raise MstarError(
            f"cannot save outputs as {str(path)!r}: use one of {', '.join(OUTPUT_WRITERS)}"
        )
    return writer


@dataclass
class RunSummary:
    """What one request produced, and when."""

    model: str
    seconds_to_first_output: float | None = None
    seconds_to_first_audio: float | None = None
    seconds_total: float = 0.0
    audio_chunks: int = 0
    audio_seconds: float = 0.0
    sample_rate: int | None = None
    text: str = ""
    images: list[list[int]] = field(default_factory=list)
    latents: list[dict[str, Any]] = field(default_factory=list)
    actions: list[list[int]] = field(default_factory=list)
    action_values: list[float] = field(default_factory=list)

    @property
    def real_time_factor(self) -> float | None:
        """End-to-end seconds per second of audio (below 1: faster than real time)."""
        return self.seconds_total / self.audio_seconds if self.audio_seconds else None


async def run_request(
    model: Model,
    inputs: dict[str, Any],
    *,
    echo: bool = False,
    keep: list[Any] | None = None,
    placement: Placement | None = None,
    launcher: Launcher | None = None,
) -> RunSummary:
    """Open a runtime for ``model`` (with ``placement`` and ``launcher``, as ``open_runtime``),
    run one request with ``inputs``, and summarise its outputs.

    With ``echo``, text is printed to stdout as it is generated; ``keep`` collects every
    output, in order (for saving them).

    Raises:
        What ``open_runtime`` and the request raise.
    """
    from mstar_async.runtime import open_runtime

    summary = RunSummary(model.name)
    async with open_runtime(model, placement=placement, launcher=launcher) as runtime:
        started = time.perf_counter()
        async with runtime.generate(**inputs) as outputs:
            async for item in outputs:
                now = time.perf_counter() - started
                if summary.seconds_to_first_output is None:
                    summary.seconds_to_first_output = now
                if isinstance(item, AudioChunk) and summary.seconds_to_first_audio is None:
                    summary.seconds_to_first_audio = now
                if keep is not None:
                    keep.append(item)
                if echo and isinstance(item, TextDelta):
                    print(item.text, end="", flush=True)
                _account(summary, item)
        if echo and summary.text:
            print()
        summary.seconds_total = time.perf_counter() - started
    return summary


def _account(summary: RunSummary, item: Any) -> None:
    if isinstance(item, AudioChunk):
        summary.audio_chunks += 1
        summary.audio_seconds += item.seconds
        summary.sample_rate = item.sample_rate
    elif isinstance(item, TextDelta):
        summary.text += item.text
    elif isinstance(item, ImageOutput):
        summary.images.append(list(item.image.shape))
    elif isinstance(item, LatentOutput):
        summary.latents.append({"step": item.step, "shape": list(item.latent.shape)})
    elif isinstance(item, ActionOutput):
        summary.actions.append(list(item.actions.shape))
        summary.action_values = [round(float(v), 4) for v in item.actions.flatten()[:6]]


def _print(summary: RunSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**summary.__dict__, "real_time_factor": summary.real_time_factor}))
        return
    first = summary.seconds_to_first_output
    if summary.audio_chunks:
        print(
            f"audio: {summary.audio_chunks} chunks, {summary.audio_seconds:.2f} s at "
            f"{summary.sample_rate} Hz"
        )
    if summary.seconds_to_first_audio is not None and summary.real_time_factor is not None:
        print(
            f"TTFA {summary.seconds_to_first_audio * 1000:.1f} ms; "
            f"RTF {summary.real_time_factor:.3f} (end-to-end time / audio duration)"
        )
    for shape in summary.images:
        print(f"image: {'x'.join(map(str, shape))}")
    for latent in summary.latents:
        print(f"latent step {latent['step']}: {'x'.join(map(str, latent['shape']))}")
    for shape in summary.actions:
        print(f"actions: {'x'.join(map(str, shape))} chunk, first values {summary.action_values}")
    if first is not None:
        print(
            f"first output after {first * 1000:.1f} ms; request took {summary.seconds_total:.3f} s"
        )


def _ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise MstarError(f"--join takes ranks like 0,1; got {text!r}") from None


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from mstar_async.loop import run_async

    try:
        print(f"building {args.model} ...", file=sys.stderr)
        writer = output_writer(args.output) if args.output else None
        model = build_model(args.model)
        inputs = parse_inputs(model, extra)
        placement = None if args.placement is None else Placement.from_yaml(args.placement)
        launcher: Launcher | None = None
        if args.listen is not None:
            if placement is None:
                raise MstarError("--listen needs --placement: its hosts: say which ranks join")
            launcher = RemoteLauncher.for_placement(placement, args.listen)
            if args.join is not None:
                launcher = RemoteLauncher(args.listen, ranks=_ranks(args.join))
            for rank in sorted(launcher.ranks or ()):
                print(f"rank {rank}: waiting for `{launcher.command(rank)}`", file=sys.stderr)
        outputs: list[Any] = []
        run = functools.partial(
            run_request, echo=not args.json, keep=outputs, placement=placement, launcher=launcher
        )
        summary: RunSummary = run_async(run, model, inputs)
        saved = writer(Path(args.output), outputs) if writer is not None else None
    except MstarError as exc:
        print(f"mstar run: {exc}", file=sys.stderr)
        return 2
    _print(summary, args.json)
    if saved:
        print(saved, file=sys.stderr if args.json else sys.stdout)
    return 0
