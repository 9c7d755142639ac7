"""Where a command's worker ranks run, from its options: ``--listen``/``--join`` (ranks that
``mstar worker`` processes join over TCP), ``--ray`` (ranks as Ray actors on a cluster), and
the ``--curve-keys`` that secure either. ``mstar run`` and ``mstar serve`` share them.

Everything here is checked before a model is built: a mistake is an ``MstarError`` whose
message the command prints (exit status 2).
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mstar_async.cli.keys import add_curve_keys_option, load_curve_keys
from mstar_async.errors import MstarError
from mstar_async.placement import Placement
from mstar_async.transport import CurveKeys
from mstar_async.transport.secure import check_listen
from mstar_async.worker.launchers import Launcher, RayLauncher, import_ray
from mstar_async.worker.remote import RemoteLauncher

__all__ = [
    "LauncherFactory",
    "add_listen_options",
    "add_ray_option",
    "launcher_factories",
    "parse_join",
    "ray_address",
    "ray_launcher_factory",
    "remote_launcher",
]

#: Makes a new launcher for one runtime (a launcher serves one pool at a time).
LauncherFactory = Callable[[], Launcher]

#: Where ``ray start`` notes the address of the cluster it runs on this host (``"auto"``).
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def add_listen_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--listen``, ``--join`` and ``--curve-keys`` to ``parser``. Never raises."""
    parser.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        help=(
            "with --placement: ranks whose hosts: entry is another host join here over TCP "
            "(run 'mstar worker --conductor tcp://THIS_HOST:PORT --rank N' on each)"
        ),
    )
    parser.add_argument(
        "--join",
        metavar="RANKS",
        help=(
            "with --listen: the ranks that join over TCP, comma-separated (default: those "
            "hosts: puts on other hosts); e.g. 0,1 to try it all on one host"
        ),
    )
    add_curve_keys_option(parser, "the workers' traffic over TCP")


def add_ray_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--ray ADDRESS`` to ``parser``. Never raises."""
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help=(
            "run each placed model's ranks as Ray actors on this cluster: auto (the cluster "
            "`ray start` runs on this host) or HOST:PORT; one placement group per model, with "
            "the placement's resources: and strategy:. Without --curve-keys, keys are made "
            "for the run and handed to the actors"
        ),
    )


def parse_join(text: str) -> list[int]:
    """``--join``'s ranks, e.g. ``"0,1"``.

    Raises:
        MstarError: not comma-separated integers.
    """
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise MstarError(f"--join takes ranks like 0,1; got {text!r}") from None


def remote_launcher(args: argparse.Namespace, placement: Placement | None) -> RemoteLauncher | None:
    """The launcher ``--listen`` and ``--join`` ask for, or None without ``--listen``.

    Raises:
        MstarError: one is given without what it needs, a value is wrong, the key folder
            cannot be used, or ``--listen`` is not loopback and there are no keys.
    """
    join = args.join
    if args.listen is None:
        if join is not None:
            raise MstarError("--join needs --listen: the address the ranks join")
        return None
    if placement is None:
        raise MstarError("--listen needs --placement: its hosts: say which ranks join")
    keys = load_curve_keys(args.curve_keys)
    try:
        if join is not None:
            launcher = RemoteLauncher(args.listen, ranks=parse_join(join), curve_keys=keys)
        else:
            launcher = RemoteLauncher.for_placement(placement, args.listen, curve_keys=keys)
    except ValueError as exc:
        raise MstarError(f"--join {join}: {exc}") from None
    if keys is None:  # before the model is built: its open() would refuse only after that
        check_listen(f"tcp://{launcher.listen_host}:{launcher.listen_port}")
    return launcher


def ray_address(text: str) -> str:
    """Check ``--ray``'s address: ``auto`` with a cluster noted on this host, or ``HOST:PORT``
    where something listens (Ray's GCS). Blocks up to 2 s on a TCP connect.

    Raises:
        MstarError: the address is malformed, or no cluster is there (the message says how to
            start one).
    """
    if text == "auto":
        if os.environ.get("RAY_ADDRESS") or RAY_CURRENT_CLUSTER.exists():
            return text
        raise MstarError(
            "--ray auto: no Ray cluster runs on this host (no "
            f"{RAY_CURRENT_CLUSTER}): start one with `ray start --head`, or give HOST:PORT"
        )
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in text:
        raise MstarError(
            f"--ray {text}: expected auto or HOST:PORT (the head's `ray start --head --port`, "
            "e.g. 10.0.0.1:6379)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            pass
    except OSError as exc:
        raise MstarError(
            f"--ray {text}: no Ray cluster answers there ({exc.strerror or exc}); is "
            "`ray start --head` running on that host and port?"
        ) from None
    return text


def ray_launcher_factory(
    address: str, placement: Placement, keys: CurveKeys | None, **options: Any
) -> LauncherFactory:
    """A factory of ``RayLauncher.for_placement(placement, address)`` launchers; each gets
    ``keys``, or, without, keys made for its run (``CurveKeys.for_run``), which the pool hands
    its actors in their configuration.

    Raises:
        MstarError: Ray is not installed (checked now, not when a launcher is made).
    """
    import_ray()

    def make() -> Launcher:
        run_keys = keys if keys is not None else CurveKeys.for_run()
        return RayLauncher.for_placement(placement, address, curve_keys=run_keys, **options)

    return make


def launcher_factories(
    args: argparse.Namespace, placements: dict[str, Placement]
) -> dict[str, LauncherFactory]:
    """What starts each placed model's ranks (by model name), as ``--ray``, ``--listen`` and
    ``--join`` say; empty: child processes of this one.

    Raises:
        MstarError: ``--ray`` and ``--listen`` together, either without a placement (or
            ``--listen`` with more than one), a bad ``--ray`` address or no cluster there, Ray
            not installed, an unusable key folder, or a ``--listen``/``--join`` mistake.
    """
    if args.ray is not None and args.listen is not None:
        raise MstarError("--ray and --listen both say where ranks run: give one of them")
    if args.ray is not None:
        if not placements:
            raise MstarError("--ray runs the ranks of placed models: give --placement [MODEL=]FILE")
        address = ray_address(args.ray)
        keys = load_curve_keys(args.curve_keys)
        return {name: ray_launcher_factory(address, p, keys) for name, p in placements.items()}
    if args.listen is not None and len(placements) > 1:
        raise MstarError(
            f"--listen serves the ranks of one placed model, not {len(placements)}: place one"
        )
    for name, placement in placements.items():
        if remote_launcher(args, placement) is not None:  # checked now, made once per runtime
            return {name: functools.partial(_joined, args, placement)}
    remote_launcher(args, None)  # --listen or --join without a placement: says so
    return {}


def _joined(args: argparse.Namespace, placement: Placement) -> Launcher:
    launcher = remote_launcher(args, placement)
    assert launcher is not None  # checked by launcher_factories
    return launcher
