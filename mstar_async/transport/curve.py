"""CURVE keys for the TCP sockets between a runtime and its workers: load them, make them.

One folder holds two keypairs in ZeroMQ's certificate format (``zmq.auth.create_certificates``;
a ``NAME.key`` file holds a public key, ``NAME.key_secret`` both keys of the pair):

- ``runtime``: the sockets workers dial on the runtime's host (the launcher's control socket,
  the pool's step socket) serve with it, and every worker checks that key before it talks;
- ``worker``: every worker dials with it, and serves its peer socket (tensors worker to worker)
  with it too; servers admit no client key but this one.

So the runtime's host needs ``runtime.key_secret`` and ``worker.key`` (plus
``worker.key_secret`` when it also runs local ranks over TCP), and a worker's host needs
``worker.key_secret`` and ``runtime.key``. Nothing here sends a key anywhere: the CURVE
handshake proves that each side holds its secret key without sending it.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq.auth

from mstar_async.transport.errors import TransportError

__all__ = ["KEY_NAMES", "CurveClient", "CurveKeys", "CurveServer", "generate_curve_keys"]

#: The two keypairs of a key folder, by the name of their files.
KEY_NAMES = ("runtime", "worker")


@dataclass(frozen=True)
class CurveServer:
    """What a CURVE server socket needs: its keypair (Z85) and the client public keys it
    admits."""

    public: bytes
    secret: bytes = field(repr=False)
    clients: frozenset[bytes]


@dataclass(frozen=True)
class CurveClient:
    """What a CURVE client socket needs: its keypair (Z85) and the server public key it
    accepts."""

    public: bytes
    secret: bytes = field(repr=False)
    server: bytes


@dataclass(frozen=True)
class CurveKeys:
    """The keys of one folder; a secret key is None where its file is not on this host.

    The four methods give each socket its part: ``runtime_server`` for the runtime's sockets
    that workers dial, ``runtime_client`` for a worker dialing them, ``peer_server`` and
    ``peer_client`` for tensors between workers.

    ``folder`` is None for keys made for one run (``for_run``), which live in memory only.
    """

    folder: Path | None
    runtime_public: bytes
    worker_public: bytes
    runtime_secret: bytes | None = field(default=None, repr=False)
    worker_secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> CurveKeys:
        """Read the keys in ``folder``: each pair's public key (from either of its files) and
        its secret key where ``NAME.key_secret`` is there. Blocks on file reads.

        Raises:
            TransportError: the folder or a public key is missing, a file is not a key file,
                or a secret key file is open to other users (any group or other mode bit).
        """
        where = Path(folder).expanduser()
        if not where.is_dir():
            raise TransportError(
                f"no CURVE key folder {where}: make one with `mstar keys generate {where}`"
            )
        publics: dict[str, bytes] = {}
        secrets: dict[str, bytes | None] = {}
        for name in KEY_NAMES:
            publics[name], secrets[name] = _load_pair(where, name)
        return cls(
            where,
            publics["runtime"],
            publics["worker"],
            secrets["runtime"],
            secrets["worker"],
        )

    @classmethod
    def for_run(cls) -> CurveKeys:
        """Fresh runtime and worker keypairs, in memory only: for a runtime that starts its
        workers itself and hands each what it needs (``worker_material``). Never raises."""
        runtime_public, runtime_secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        return cls(None, runtime_public, worker_public, runtime_secret, worker_secret)

    def worker_material(self) -> dict[str, str]:
        """What a worker needs, as text (Z85): the runtime's public key and the worker keypair,
        never the runtime's secret key. ``from_material`` reads it back.

        Raises:
            TransportError: the worker's secret key is not held here.
        """
        return {
            "runtime_public": self.runtime_public.decode(),
            "worker_public": self.worker_public.decode(),
            "worker_secret": self._secret("worker").decode(),
        }

    @classmethod
    def from_material(cls, material: Mapping[str, str]) -> CurveKeys:
        """The keys ``worker_material`` wrote (no folder, no runtime secret).

        Raises:
            TransportError: a key is missing or not a 40-character Z85 key.
        """
        keys: dict[str, bytes] = {}
        for name in ("runtime_public", "worker_public", "worker_secret"):
            value = material.get(name)
            if not isinstance(value, str) or len(value) != 40:
                raise TransportError(f"the worker's CURVE key material lacks a valid {name}")
            keys[name] = value.encode()
        return cls(
            None,
            keys["runtime_public"],
            keys["worker_public"],
            worker_secret=keys["worker_secret"],
        )

    def runtime_server(self) -> CurveServer:
        """The runtime's sockets that workers dial: the runtime keypair, admitting workers.

        Raises:
            TransportError: ``runtime.key_secret`` is not in the folder.
        """
        return CurveServer(self.runtime_public, self._secret("runtime"), self._workers())

    def runtime_client(self) -> CurveClient:
        """A worker dialing the runtime: the worker keypair, accepting the runtime's key.

        Raises:
            TransportError: ``worker.key_secret`` is not in the folder.
        """
        return CurveClient(self.worker_public, self._secret("worker"), self.runtime_public)

    def peer_server(self) -> CurveServer:
        """A worker's peer socket: the worker keypair, admitting workers.

        Raises:
            TransportError: ``worker.key_secret`` is not in the folder.
        """
        return CurveServer(self.worker_public, self._secret("worker"), self._workers())

    def peer_client(self) -> CurveClient:
        """A worker dialing another worker's peer socket: the worker keypair both ways.

        Raises:
            TransportError: ``worker.key_secret`` is not in the folder.
        """
        return CurveClient(self.worker_public, self._secret("worker"), self.worker_public)

    def _workers(self) -> frozenset[bytes]:
        return frozenset({self.worker_public})

    def _secret(self, name: str) -> bytes:
        secret = self.runtime_secret if name == "runtime" else self.worker_secret
        if secret is None and self.folder is None:
            raise TransportError(f"these CURVE keys, made for one run, hold no {name} secret key")
        if secret is None:
            raise TransportError(
                f"the CURVE key folder {self.folder} has no {name}.key_secret, which this "
                f"host needs: copy it from the folder `mstar keys generate` made"
            )
        return secret


def _load_pair(folder: Path, name: str) -> tuple[bytes, bytes | None]:
    secret_file = folder / f"{name}.key_secret"
    public_file = folder / f"{name}.key"
    source = secret_file if secret_file.exists() else public_file
    if not source.exists():
        raise TransportError(
            f"the CURVE key folder {folder} has neither {public_file.name} nor "
            f"{secret_file.name}: make the folder with `mstar keys generate`"
        )
    mode = stat.S_IMODE(source.stat().st_mode)
    if source is secret_file and mode & 0o077:
        # As ssh does: a secret that others can read may be someone else's by now.
        raise TransportError(
            f"{secret_file} is open to other users (mode {mode:o}): `chmod 600 {secret_file}`"
        )
    try:
        public, secret = zmq.auth.load_certificate(source)
    except (OSError, ValueError) as exc:
        raise TransportError(f"cannot read the CURVE key file {source}: {exc}") from exc
    return public, secret


def generate_curve_keys(folder: str | os.PathLike[str]) -> CurveKeys:
    """Make a runtime and a worker keypair in ``folder`` (created 0700 when missing; secret
    files 0600, never visible with looser modes). Blocks on file writes.

    Raises:
        TransportError: a key file of either pair is already there (nothing is overwritten),
            or the folder cannot be written.
    """
    where = Path(folder).expanduser()
    taken = [
        path.name
        for name in KEY_NAMES
        for path in (where / f"{name}.key", where / f"{name}.key_secret")
        if path.exists()
    ]
    if taken:
        raise TransportError(f"{where} already holds {', '.join(taken)}: not overwriting keys")
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written in a private folder first (mkdtemp makes it 0700), then moved in.
        staging = Path(tempfile.mkdtemp(prefix=".mstar-keys-", dir=where))
        try:
            for name in KEY_NAMES:
                public_file, secret_file = zmq.auth.create_certificates(staging, name)
                os.chmod(secret_file, 0o600)
                os.chmod(public_file, 0o644)
                os.replace(secret_file, where / f"{name}.key_secret")
                os.replace(public_file, where / f"{name}.key")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise TransportError(f"cannot write CURVE keys to {where}: {exc}") from exc
    return CurveKeys.load(where)
