"""The control conversation between a ``RemoteLauncher`` and the ``mstar worker`` processes that
join it over TCP: who joins as which rank, what it builds, and whether both sides are alive.

It is a conversation of its own, on its own socket (the launcher's ROUTER at the address users
give ``mstar worker --conductor``; each worker's DEALER), apart from the step traffic on the
pool's socket: joining and liveness must keep working while a worker builds its engines and
while either side's event loop is busy with a forward, so both ends serve it from a thread.
The messages are small typed JSON structs, one frame each:

- worker -> launcher: :class:`Join` (resent until answered), then :class:`Beat` every
  ``heartbeat`` seconds, and :class:`Bye` with its exit status when it ends;
- launcher -> worker: :class:`Welcome` (the worker's configuration) or :class:`Refuse` (why
  it cannot join; the worker exits), :class:`Beat` back for each beat, and :class:`Stop` (end
  now: the runtime killed this worker or no longer knows it).

Either side that hears nothing from the other for ``timeout`` seconds treats it as gone.
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from mstar_async.errors import MstarError

__all__ = [
    "PROTOCOL",
    "Beat",
    "Bye",
    "ControlMessage",
    "Join",
    "Refuse",
    "Stop",
    "Welcome",
    "decode_control",
    "encode_control",
    "is_this_host",
    "split_tcp",
]

#: Bumped when the conversation changes; a worker of another version is refused by name.
PROTOCOL = 2


class Join(msgspec.Struct, tag="join", frozen=True):
    """A worker asks to serve ``rank``; ``nonce`` tells its resends from another worker."""

    rank: int
    nonce: str
    pid: int
    host: str
    protocol: int = PROTOCOL


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """The joining worker's ``WorkerConfig`` (as a dict) and the liveness timing to keep.

    ``data_host`` is where the worker dials the pool's step socket at ``data_port``; empty
    means the host the worker already reached the launcher at.
    """

    config: dict[str, Any]
    data_port: int
    heartbeat: float
    timeout: float
    data_host: str = ""


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    """The worker cannot join: ``reason`` says why and what to do."""

    reason: str


class Beat(msgspec.Struct, tag="beat", frozen=True):
    """A heartbeat (worker -> launcher, with its nonce) or its answer (launcher -> worker)."""

    nonce: str = ""


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """The worker is ending with exit status ``code``; ``error`` is the exception that ended
    it, if one did (e.g. a checkpoint missing on its host)."""

    nonce: str
    code: int
    error: str = ""


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """End now; ``reason`` goes to the worker's log."""

    reason: str


ControlMessage = Join | Welcome | Refuse | Beat | Bye | Stop

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ControlMessage)


def encode_control(message: ControlMessage) -> bytes:
    """One control message as its JSON frame. Never raises for a message of this module."""
    return _encoder.encode(message)


def decode_control(frame: bytes) -> ControlMessage | None:
    """The control message in ``frame``, or None when it is not one (a stray or foreign
    client: ignored rather than taking the conversation down). Never raises."""
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError:
        return None


def split_tcp(address: str, *, default_host: str = "0.0.0.0") -> tuple[str, int]:
    """``tcp://HOST:PORT``, ``HOST:PORT`` or ``:PORT`` as ``(host, port)``; ``[v6]`` brackets
    are kept, since ZeroMQ wants them.

    Raises:
        MstarError: the address has no port, or the port is not 0..65535.
    """
    text = address.removeprefix("tcp://")
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise MstarError(
            f"{address!r} is not a TCP address: write tcp://HOST:PORT (e.g. tcp://10.0.0.1:5555)"
        )
    return host or default_host, int(port_text)


def is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine: one of its addresses binds
    here. Binding, rather than comparing with what this host's name resolves to, also finds
    the LAN address of a host whose name resolves to 127.0.1.1 only. Never raises; blocks on
    a DNS lookup of ``host``."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
        except OSError:
            continue
        return True
    return False
