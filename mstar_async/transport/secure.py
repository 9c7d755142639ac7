"""CURVE on ZeroMQ sockets: a server's keys, a client's keys, the gate that admits clients by
key, and the rule for TCP without keys.

A server socket gets its keypair, ``curve_server`` and a ZAP domain of its own; the context's
:class:`Gate` (ZeroMQ's ZAP authenticator) answers every client handshake on it, admitting
only the public keys that socket's :class:`~mstar_async.transport.curve.CurveServer` names. A
refused client never gets a message to the socket. A client socket gets its keypair and the
server's public key, so it completes no handshake with a server that lacks the secret key.

Without keys a TCP socket binds a loopback address only (:func:`check_listen`): elsewhere,
anyone who reaches the port could send a worker steps or answer its join.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from mstar_async.logs import get_logger
from mstar_async.transport.curve import CurveClient, CurveServer
from mstar_async.transport.errors import TransportError

__all__ = ["Gate", "check_listen", "is_loopback", "secure_client", "secure_server"]

log = get_logger("mstar_async.transport.secure")

_WARN_EVERY_S = 10.0


class _Admit:
    """The ZAP callback for one domain: admits its client keys, counts and logs the rest."""

    def __init__(self, gate: Gate, clients: frozenset[bytes]) -> None:
        self.gate = gate
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.clients:
            return True
        self.gate._refuse(domain, key)
        return False


class Gate:
    """ZeroMQ's ZAP authenticator for one context; :meth:`admit` says which client keys a
    server socket (by its ZAP domain) lets in.

    It answers handshakes from a thread of its own (``zmq.auth``'s ``ThreadAuthenticator``),
    not from the event loop: a worker's loop may be busy with a forward, and a handshake need
    not wait for it; closing then stays synchronous and joins that thread.

    Raises:
        RuntimeError: the authenticator's thread did not start.
    """

    def __init__(self, context: zmq.Context[Any]) -> None:
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self.refused = 0
        self._next_warning = 0.0

    def admit(self, domain: str, clients: frozenset[bytes]) -> None:
        """Admit ``clients`` (Z85 public keys), and no one else, on sockets of ``domain``.
        Call it before such a socket binds. Never raises."""
        self._auth.configure_curve_callback(domain, _Admit(self, clients))

    def close(self) -> None:
        """Stop answering handshakes (joins the thread). Idempotent; never raises."""
        self._auth.stop()

    def _refuse(self, domain: str, key: bytes) -> None:
        # A refused client reconnects every 100 ms: say so now and then, not each time.
        self.refused += 1
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + _WARN_EVERY_S
            log.warning(
                "curve.refused", domain=domain, client_key=key.decode(), refused=self.refused
            )


def secure_server(sock: zmq.Socket[Any], server: CurveServer, domain: str) -> None:
    """Make ``sock`` a CURVE server whose handshakes the gate answers under ``domain``. Call
    it before the socket binds. Never raises for an open socket."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def secure_client(sock: zmq.Socket[Any], client: CurveClient) -> None:
    """Make ``sock`` a CURVE client that talks only to the server holding ``client.server``'s
    secret key. Call it before the socket connects. Never raises for an open socket."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, client.server)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, ``[v6]`` brackets allowed, or a name) is loopback only:
    an address in 127.0.0.0/8 or ::1, or a name that resolves to nothing else. Never raises;
    blocks on a DNS lookup of a name."""
    bare = host.strip("[]")
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_listen(endpoint: str) -> None:
    """Refuse to listen without CURVE on a TCP address other than loopback. ``ipc://`` and
    ``inproc://`` endpoints pass: they stay on this host, in private folders.

    Raises:
        TransportError: ``endpoint`` is TCP on an address that is not loopback (``0.0.0.0``,
            ``*``, an interface, a LAN address); the message says how to give keys.
    """
    if not endpoint.startswith("tcp://"):
        return
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if not is_loopback(host):
        raise TransportError(
            f"refusing to listen on {endpoint} without CURVE keys: anyone who reaches that "
            "port could drive the workers. Make keys with `mstar keys generate DIR` and give "
            "them to both sides (--curve-keys DIR, or MSTAR_CURVE_KEYS=DIR; curve_keys= on "
            "a launcher), or listen on 127.0.0.1 for workers on this host only"
        )
