"""``mstar serve [MODEL ...]``: serve models over HTTP (OpenAI-compatible routes + /generate)."""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mstar_async.cli.launch import add_listen_options, add_ray_option, launcher_factories
from mstar_async.errors import MstarError
from mstar_async.placement import Placement

#: The environment variable ``mstar serve --api-key`` defaults to.
API_KEY_VARIABLE = "MSTAR_API_KEY"

#: What ``mstar serve`` serves when given no model: a chat model and a speech model, so the
#: text and speech routes answer out of the box (``--path`` alone serves causal-lm from it).
DEFAULT_MODELS = ("causal-lm", "orpheus")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _seconds(*, positive: bool) -> Callable[[str], float]:
    """A parser of seconds up to an hour: above 0 when ``positive``, else 0 or more."""
    low = "above 0" if positive else "from 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (value > 0 if positive else value >= 0) or value > 3600:
            raise argparse.ArgumentTypeError(f"expected seconds {low} to 3600, got {text!r}")
        return value

    return parse


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the ``mstar`` subcommands."""
    serve = sub.add_parser(
        "serve",
        help="serve models over HTTP",
        description="Serve models over HTTP: /v1/chat/completions, /v1/completions, "
        "/v1/audio/speech, /v1/images/generations, /v1/models (OpenAI-compatible), the "
        "/v1/audio/speech/stream websocket, /generate (every model, streamed), /health "
        "(liveness), /health/ready (readiness), /metrics.",
    )
    serve.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help=f"model names from 'mstar models' (default: {' '.join(DEFAULT_MODELS)})",
    )
    serve.add_argument(
        "--path",
        help="a real checkpoint of the model (one model only; e.g. a Llama/Qwen2 HF folder "
        "for causal-lm); with --placement every rank reads it at this same path on its own "
        "node (--ray, --listen: copy or mount it there)",
    )
    serve.add_argument(
        "--quantize",
        metavar="FORM",
        help="weight form of the served models that take one (causal-lm): auto (the embedded "
        "SmolLM2's measured default), none, int8, int4",
    )
    serve.add_argument(
        "--placement",
        action="append",
        default=[],
        metavar="[MODEL=]FILE",
        help="a placement YAML file for a model (without MODEL=: the only model served)",
    )
    add_ray_option(serve)
    add_listen_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    serve.add_argument(
        "--max-concurrent",
        type=_positive,
        default=None,
        metavar="N",
        help="requests in flight per model before 429 (default 64)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help="require 'Authorization: Bearer KEY' on every route but /health and "
        f"/health/ready (default: the {API_KEY_VARIABLE} environment variable; none: no key)",
    )
    serve.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOST[,HOST...]",
        help="Host header names answered ('*': any; default: loopback names when bound to "
        "loopback, any otherwise)",
    )
    serve.add_argument(
        "--voices-dir",
        default=None,
        metavar="DIR",
        help="keep voices registered with POST /v1/audio/voices here (models that clone "
        "voices, e.g. qwen3-tts); they persist across restarts",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=None,
        metavar="N",
        help="largest request body before 413 (default 8 MiB)",
    )
    serve.add_argument(
        "--drain-seconds",
        type=_seconds(positive=False),
        default=None,
        metavar="S",
        help="after SIGTERM or Ctrl-C, seconds running requests get to finish before they are "
        "cancelled and the server exits (default 10; whole seconds)",
    )
    serve.add_argument(
        "--max-text-chars",
        type=_positive,
        default=None,
        metavar="N",
        help="longest speech text a request or websocket segment may carry before 400 "
        "(default 4096 characters); prompts are held to each model's context length",
    )
    serve.add_argument(
        "--stall-seconds",
        type=_seconds(positive=True),
        default=None,
        metavar="S",
        help="/health/ready answers 503 while a model has steps waiting and no forward has "
        "finished for S seconds (default 30), or a worker rank is down or restarting",
    )
    serve.set_defaults(handler=_serve)


def placements(models: list[str], options: list[str]) -> dict[str, Placement]:
    """``[MODEL=]FILE`` options as placements by model name.

    Raises:
        MstarError: an option names a model not served, or omits the model while several are.
    """
    out: dict[str, Placement] = {}
    for option in options:
        name, sep, file = option.rpartition("=")
        if not sep:
            if len(models) != 1:
                raise MstarError(f"--placement {option}: say which model, as MODEL=FILE")
            name = models[0]
        if name not in models:
            raise MstarError(f"--placement {option}: {name!r} is not served ({models})")
        out[name] = Placement.from_yaml(Path(file))
    return out


def check_port(host: str, port: int) -> None:
    """Check that a server can listen on ``host:port`` now, before any model loads.

    Raises:
        MstarError: the port is out of range or taken, or ``host`` is no address here.
    """
    if not 0 <= port < 65536:
        raise MstarError(f"--port {port}: expected 0 to 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:  # socket.gaierror included
        raise MstarError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _specs(args: argparse.Namespace) -> list[Any]:
    """The served models, checked and built (nothing printed).

    Raises:
        MstarError: a model, a placement, ``--path`` or the address is wrong.
    """
    from mstar_async.cli.run import accepts, build_options
    from mstar_async.models import build_model, model_entry
    from mstar_async.server import ModelSpec

    if args.path is not None and len(args.models) != 1:
        raise MstarError("--path is the checkpoint of one model: serve one model with it")
    entries = [model_entry(name) for name in args.models]
    # --quantize goes to the served models that take it, the others are served as they are.
    takers = [entry.name for entry in entries if accepts(entry, "quantize")]
    if args.quantize is not None and not takers:
        raise MstarError(f"--quantize: none of {', '.join(args.models)} takes a weight form")
    plain = argparse.Namespace(**{**vars(args), "quantize": None})
    options = [build_options(entry, plain) for entry in entries]
    for entry, option in zip(entries, options, strict=True):
        if args.quantize is not None and entry.name in takers:
            option["quantize"] = args.quantize
    where = placements(args.models, args.placement)
    launchers = launcher_factories(args, where)
    check_port(args.host, args.port)
    specs = []
    for entry, option in zip(entries, options, strict=True):
        try:
            model = build_model(entry.name, **option)
        except (ValueError, TypeError, OSError) as exc:
            raise MstarError(f"cannot build {entry.name}: {exc}") from None
        spec = ModelSpec(
            model, placement=where.get(entry.name), make_launcher=launchers.get(entry.name)
        )
        specs.append(spec)
    return specs


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from mstar_async.loop import run_async
    from mstar_async.server import (
        DEFAULT_MAX_CONCURRENT,
        DEFAULT_MAX_TEXT_CHARS,
        create_app,
        serve,
    )
    from mstar_async.server.guard import DEFAULT_MAX_BODY_BYTES, hosts_to_answer
    from mstar_async.server.readiness import DEFAULT_STALL_SECONDS
    from mstar_async.server.run import DRAIN_SECONDS

    say = functools.partial(print, file=sys.stderr, flush=True)
    url = f"http://{args.host}:{args.port}"
    if not args.models:
        args.models = ["causal-lm"] if args.path is not None else list(DEFAULT_MODELS)
    try:
        app = create_app(
            _specs(args),
            max_concurrent=args.max_concurrent or DEFAULT_MAX_CONCURRENT,
            progress=lambda line: say(f"  {line}"),
            api_key=args.api_key,
            allowed_hosts=hosts_to_answer(args.allowed_hosts, args.host),
            max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
            max_text_chars=args.max_text_chars or DEFAULT_MAX_TEXT_CHARS,
            stall_after_s=args.stall_seconds or DEFAULT_STALL_SECONDS,
            voices_dir=args.voices_dir,
        )
    except (MstarError, ValueError) as exc:
        say(f"mstar serve: {exc}")
        return 2
    say(f"serving {', '.join(args.models)} at {url} once loaded (Ctrl-C stops)")
    try:
        drain = DRAIN_SECONDS if args.drain_seconds is None else args.drain_seconds
        run_async(functools.partial(serve, app, host=args.host, port=args.port, drain_s=drain))
    except SystemExit as exc:
        say(f"mstar serve: the server did not start (exit {exc.code}); see the log above")
        return 1
    except KeyboardInterrupt:
        pass
    return 0
