"""``mstar run MODEL [--input value ...]``: one request, its outputs summarised, with timings.

Any ``--name value`` after the model becomes the request input ``name`` (dashes become
underscores), converted to the type of that input's default in the model's program; the inputs
a model registers as ``required`` must be given (a speech model's ``--text``). ``--path``,
``--snac-path`` and ``--size`` go to the model's builder (a real checkpoint, a real codec, a
seeded size) for the models whose builders take them.
``-o/--output PATH`` saves what the request produced; the writer is chosen by the file's
extension from ``OUTPUT_WRITERS`` (audio: .wav, .flac, .ogg, .mp3, .opus, .pcm, .raw, .f32),
so a new kind of output registers its extensions there with ``register_output_writer``.

Everything the command line says is checked before anything is built or printed: a mistake
is one line on stderr and exit status 2. A request that fails, or an output that cannot be
saved after all, is one line and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar_async.audio import EXTENSIONS as AUDIO_EXTENSIONS
from mstar_async.audio import write_audio
from mstar_async.cli.launch import add_listen_options, remote_launcher
from mstar_async.errors import MstarError
from mstar_async.graph import Model
from mstar_async.logs import muted
from mstar_async.models import ModelEntry, build_model, list_models, model_entry
from mstar_async.outputs import ActionOutput, AudioChunk, ImageOutput, LatentOutput, TextDelta
from mstar_async.placement import Placement
from mstar_async.worker.launchers import Launcher
from mstar_async.worker.remote import RemoteLauncher


def add_run_parser(sub: Any) -> None:
    """Add ``run`` to the ``mstar`` subcommands."""
    run = sub.add_parser(
        "run",
        help="run one request on a model and print what it produced",
        description=(
            "Run one request. Extra --name value options become the program's inputs. Exit "
            "status: 0 done, 1 the request (or saving its outputs) failed, 2 a mistake in the "
            "command (refused before anything ran)."
        ),
        allow_abbrev=False,
    )
    run.add_argument("model", help="a model name from 'mstar models'")
    run.add_argument("--json", action="store_true", help="print a JSON summary")
    for option, what in BUILD_OPTIONS.items():
        run.add_argument(
            "--" + option.replace("_", "-"),
            dest=option,
            metavar=what[0],
            # Not the list of models that take it: that would import every model's code
            # for any command (a third of a second); a model that does not names them.
            help=f"{what[1]} (for the models whose builder takes it)",
        )
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
    add_listen_options(run)
    run.set_defaults(handler=_run)


#: Options of ``mstar run`` that go to the model's builder: metavar and meaning, by the
#: builder parameter they set (only models whose builder names that parameter take them).
BUILD_OPTIONS = {
    "path": ("PATH", "a real checkpoint: a folder, or a file for vjepa2"),
    "snac_path": ("FOLDER", "a real SNAC codec folder (config.json, pytorch_model.bin)"),
    "size": ("SIZE", "the seeded model's size: tiny, small (vjepa2: also vitg)"),
    "quantize": (
        "FORM",
        "weight form: auto (the embedded SmolLM2's measured default), none, int8, int4",
    ),
    "compile": (
        "BACKEND",
        "torch.compile each layer's work around its attention: inductor (its kernels kept "
        "under $MSTAR_CACHE/inductor for later starts) or another torch.compile backend",
    ),
}

#: How the type of an input's default is named in an error.
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def accepts(entry: ModelEntry, option: str) -> bool:
    """Whether the builder of ``entry`` takes the option ``option`` by name."""
    parameter = inspect.signature(entry.build).parameters.get(option)
    return parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD


def _takers(option: str) -> list[str]:
    """The models whose builders take ``option``."""
    return [entry.name for entry in list_models() if accepts(entry, option)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def input_pairs(extra: Sequence[str]) -> dict[str, str]:
    """``--name value`` pairs as ``{name: value}`` (dashes in names become underscores).

    Raises:
        MstarError: something is not a ``--name value`` pair (the message names it).
    """
    pairs: dict[str, str] = {}
    tokens = list(extra)
    while tokens:
        flag = tokens.pop(0)
        if not flag.startswith("--") or len(flag) < 3:
            raise MstarError(f"expected '--name value' pairs after the model, got {flag!r}")
        if not tokens:
            raise MstarError(f"{flag} needs a value")
        pairs[flag[2:].replace("-", "_")] = tokens.pop(0)
    return pairs


def _convert(name: str, raw: str, kind: type) -> Any:
    """``raw`` as a ``kind``.

    Raises:
        MstarError: it is not one (the message names the flag and the type it expects).
    """
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
    else:
        try:
            return kind(raw)
        except (TypeError, ValueError):
            pass
    expected = _TYPE_NAMES.get(kind, kind.__name__)
    raise MstarError(f"{_flag(name)} expects {expected}, got {raw!r}")


def typed_inputs(model: Model, pairs: dict[str, str]) -> dict[str, Any]:
    """``pairs`` as program inputs, each typed like its default in the model's program (text
    where the default is ``None`` or missing).

    Raises:
        MstarError: a name is no input of the program, or a value is not of its type.
    """
    params = dict(inspect.signature(model.program).parameters)
    params.pop(next(iter(params)))  # the request context
    inputs: dict[str, Any] = {}
    for name, raw in pairs.items():
        if name not in params:
            raise MstarError(
                f"model {model.name!r} takes no input {_flag(name)}; inputs: "
                + ", ".join(_flag(p) for p in params)
            )
        default = params[name].default
        known = default is not inspect.Parameter.empty and default is not None
        inputs[name] = _convert(name, raw, type(default) if known else str)
    return inputs


def parse_inputs(model: Model, extra: list[str]) -> dict[str, Any]:
    """Turn ``--name value`` pairs into program inputs typed like the program's defaults.

    Raises:
        MstarError: an option is malformed, names no input of the program, or has a value
            that is not of the input's type.
    """
    return typed_inputs(model, input_pairs(extra))


def build_options(entry: ModelEntry, args: argparse.Namespace) -> dict[str, Any]:
    """The builder options ``args`` gives (``--path``, ``--snac-path``, ``--size``,
    ``--quantize``, ``--compile``).

    Raises:
        MstarError: the model's builder takes no such option, or a path does not exist.
    """
    options: dict[str, Any] = {}
    for option in BUILD_OPTIONS:
        value = getattr(args, option, None)
        if value is None:
            continue
        if not accepts(entry, option):
            takers = ", ".join(_takers(option))
            raise MstarError(
                f"model {entry.name!r} takes no {_flag(option)} (models that do: {takers})"
            )
        if option.endswith("path") and not Path(value).exists():
            raise MstarError(f"{_flag(option)} {value}: no such file or folder")
        options[option] = value
    return options


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
    try:
        samples = write_audio(path, chunks)
    except (OSError, RuntimeError, ValueError) as exc:  # libsndfile's errors are RuntimeErrors
        raise MstarError(f"cannot write {path}: {exc}") from None
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


def check_writable(path: Path) -> None:
    """Check that ``path`` can be written, before anything is generated for it; a file that
    did not exist is not left behind.

    Raises:
        MstarError: it is a folder, its folder does not exist, or opening it for writing fails.
    """
    if path.is_dir():
        raise MstarError(f"cannot write {path}: it is a folder")
    if not path.parent.is_dir():
        raise MstarError(f"cannot write {path}: there is no folder {path.parent}")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise MstarError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


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


@dataclass
class _Plan:
    """A checked ``mstar run``: the model built, its inputs typed, where outputs go."""

    model: Model
    inputs: dict[str, Any]
    writer: OutputWriter | None = None
    output: Path | None = None
    placement: Placement | None = None
    launcher: RemoteLauncher | None = None


def _build(entry: ModelEntry, options: dict[str, Any]) -> Model:
    try:
        return build_model(entry.name, **options)
    except (ValueError, TypeError, OSError) as exc:
        raise MstarError(f"cannot build {entry.name}: {exc}") from None


def _plan(args: argparse.Namespace, extra: list[str]) -> _Plan:
    """Check everything the command line says, building the model; print nothing.

    Raises:
        MstarError: a mistake in the command line (the message says which).
    """
    entry = model_entry(args.model)
    options = build_options(entry, args)
    writer, output = None, None
    if args.output is not None:
        writer, output = output_writer(args.output), Path(args.output)
        check_writable(output)
    pairs = input_pairs(extra)
    missing = [_flag(name) for name in entry.required if name not in pairs]
    if missing:
        raise MstarError(f"model {entry.name!r} needs {' and '.join(missing)}")
    placement = None if args.placement is None else Placement.from_yaml(args.placement)
    launcher = remote_launcher(args, placement)
    model = _build(entry, options)
    inputs = typed_inputs(model, pairs)
    return _Plan(model, inputs, writer, output, placement, launcher)


def _execute(plan: _Plan, as_json: bool) -> tuple[RunSummary, str | None]:
    """Run the request and save its outputs; the summary and the line saying what was saved.

    Raises:
        MstarError: the runtime or the request failed, or the outputs could not be saved.
    """
    from mstar_async.loop import run_async

    outputs: list[Any] = []
    run = functools.partial(
        run_request,
        echo=not as_json,
        keep=outputs,
        placement=plan.placement,
        launcher=plan.launcher,
    )
    summary: RunSummary = run_async(run, plan.model, plan.inputs)
    saved = None
    if plan.writer is not None and plan.output is not None:
        saved = plan.writer(plan.output, outputs)
    return summary, saved


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        plan = _plan(args, extra)
    except MstarError as exc:
        print(f"mstar run: {exc}", file=sys.stderr)
        return 2
    print(f"loading {plan.model.name} ...", file=sys.stderr)
    if plan.launcher is not None:
        for rank in sorted(plan.launcher.ranks or ()):
            print(f"rank {rank}: waiting for `{plan.launcher.command(rank)}`", file=sys.stderr)
    # The request's failure is this command's one line of error, not also a log event.
    quiet = logging.getLogger("mstar_async").getEffectiveLevel() >= logging.WARNING
    try:
        with muted("request.failed") if quiet else contextlib.nullcontext():
            summary, saved = _execute(plan, args.json)
    except MstarError as exc:
        print(f"mstar run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mstar run: interrupted", file=sys.stderr)
        return 130
    _print(summary, args.json)
    if saved:
        print(saved, file=sys.stderr if args.json else sys.stdout)
    return 0
