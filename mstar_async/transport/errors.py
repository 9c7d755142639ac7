"""Errors of the transport layer, and the table that re-raises a remote error as its own class.

``TransportError`` and ``RemoteError`` live here rather than in ``mstar_async/errors.py``: that
file belongs to every layer, and these two only mean something where bytes cross a process.

A worker that fails a step sends back the *name* of the exception's class; the receiving side
looks the name up with :func:`lookup_remote_error` and raises an instance of that class, so a
``KVCacheFull`` raised in a worker surfaces as a ``KVCacheFull`` in the conductor. Every
``MstarError`` subclass in ``mstar_async.errors`` is in the table from the start; other layers
add their own with :func:`register_remote_error`. A name that is not in the table (a
``ValueError``, a class from a plugin) comes back as :class:`RemoteError`, which keeps the
remote class name.
"""

from __future__ import annotations

import mstar_async.errors as _errors
from mstar_async.errors import MstarError

__all__ = [
    "RemoteError",
    "TransportError",
    "lookup_remote_error",
    "register_remote_error",
    "remote_error_name",
]


class TransportError(MstarError):
    """A value or message could not be encoded, decoded, sent or received.

    The message names what went wrong: the unsupported type and how to register it, the
    malformed frame, the closed link, the unknown peer.
    """


class RemoteError(MstarError):
    """An exception raised in another process whose class is not known on this side.

    Attributes:
        remote_type: the remote class name as the other side sent it (``"builtins.ValueError"``).
        remote_message: the remote exception's message, ``str(exc)`` over there.
    """

    def __init__(self, remote_type: str, remote_message: str) -> None:
        super().__init__(f"{remote_type}: {remote_message}")
        self.remote_type = remote_type
        self.remote_message = remote_message


# name -> class and class -> name; names are short class names for our own errors (both sides
# run the same code, so a short name is unambiguous and keeps error headers small).
_BY_NAME: dict[str, type[MstarError]] = {}
_NAME_OF: dict[type[BaseException], str] = {}


def register_remote_error(cls: type[MstarError], name: str | None = None) -> type[MstarError]:
    """Let ``cls`` cross processes by name: a remote ``cls`` error is re-raised as ``cls``.

    ``name`` defaults to ``cls.__name__``. ``cls`` must accept a single message argument.
    Registering the same class under the same name again is a no-op; usable as a decorator.

    Raises:
        TypeError: ``cls`` is not an ``MstarError`` subclass.
        ValueError: ``name`` is already registered for a different class.
    """
    if not (isinstance(cls, type) and issubclass(cls, MstarError)):
        raise TypeError(f"register_remote_error: expected an MstarError subclass, got {cls!r}")
    key = cls.__name__ if name is None else name
    known = _BY_NAME.get(key)
    if known is not None and known is not cls:
        raise ValueError(
            f"register_remote_error: name {key!r} is already taken by "
            f"{known.__module__}.{known.__qualname__}"
        )
    _BY_NAME[key] = cls
    _NAME_OF[cls] = key
    return cls


def remote_error_name(exc: BaseException) -> str:
    """The name under which ``exc``'s class travels: its registered name, else its
    ``module.qualname`` (``builtins`` left out), so the other side can show it.

    A :class:`RemoteError` travels under the remote name it carries, so an error forwarded
    through several processes keeps its original class name. Never raises.
    """
    if isinstance(exc, RemoteError):
        return exc.remote_type
    tp = type(exc)
    name = _NAME_OF.get(tp)
    if name is not None:
        return name
    if tp.__module__ == "builtins":
        return tp.__qualname__
    return f"{tp.__module__}.{tp.__qualname__}"


def lookup_remote_error(name: str) -> type[MstarError] | None:
    """The class registered under ``name``, or ``None`` when none is. Never raises."""
    return _BY_NAME.get(name)


def _register_defaults() -> None:
    for value in vars(_errors).values():
        if isinstance(value, type) and issubclass(value, MstarError):
            register_remote_error(value)
    register_remote_error(TransportError)


_register_defaults()
