"""``mstar serve [MODEL ...]``: serve models over HTTP (OpenAI-compatible routes + /generate)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from mstar_async.errors import MstarError
from mstar_async.placement import Placement

#: What ``mstar serve`` serves when given no model: a chat model and a speech model, so the
#: text and speech routes answer out of the box (``--path`` alone serves causal-lm from it).
DEFAULT_MODELS = ("causal-lm", "orpheus")


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the ``mstar`` subcommands."""
    serve = sub.add_parser(
        "serve",
        help="serve models over HTTP",
        description="Serve models over HTTP: /v1/chat/completions, /v1/completions, "
        "/v1/audio/speech, /v1/images/generations, /v1/models (OpenAI-compatible), the "
        "/v1/audio/speech/stream websocket, /generate (every model, streamed), /health, "
        "/metrics.",
    )
    serve.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help=f"model names from 'mstar models' (default: {' '.join(DEFAULT_MODELS)})",
    )
    serve.add_argument(
        "--path",
        help="checkpoint folder of the model (one model only; e.g. a Llama/Qwen2 HF folder "
        "for causal-lm)",
    )
    serve.add_argument(
        "--placement",
        action="append",
        default=[],
        metavar="[MODEL=]FILE",
        help="a placement YAML file for a model (without MODEL=: the only model served)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    serve.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight per model before 429 (default 64)",
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


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from mstar_async.loop import run_async
    from mstar_async.models import build_model
    from mstar_async.server import DEFAULT_MAX_CONCURRENT, ModelSpec, create_app, serve

    say = functools.partial(print, file=sys.stderr, flush=True)
    url = f"http://{args.host}:{args.port}"
    if not args.models:
        args.models = ["causal-lm"] if args.path is not None else list(DEFAULT_MODELS)
    try:
        if args.path is not None and len(args.models) != 1:
            raise MstarError("--path is the checkpoint of one model: serve one model with it")
        where = placements(args.models, args.placement)
        options = {"path": args.path} if args.path is not None else {}
        specs = []
        for name in args.models:
            say(f"building {name} ...")
            specs.append(ModelSpec(build_model(name, **options), placement=where.get(name)))
        app = create_app(
            specs,
            max_concurrent=args.max_concurrent or DEFAULT_MAX_CONCURRENT,
            progress=lambda line: say(f"  {line}"),
        )
    except (MstarError, ValueError, TypeError, OSError) as exc:
        say(f"mstar serve: {exc}")
        return 2
    say(f"serving {', '.join(args.models)} at {url} once loaded (Ctrl-C stops)")
    try:
        run_async(functools.partial(serve, app, host=args.host, port=args.port))
    except SystemExit as exc:
        say(f"mstar serve: the server did not start (exit {exc.code}); see the log above")
        return 1
    except KeyboardInterrupt:
        pass
    return 0
