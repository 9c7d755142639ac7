"""Structured logging: structlog events rendered as key=value (or JSON) through stdlib logging.

The library's loggers are structlog loggers over ``logging.getLogger("mstar_async....")``, so an
embedding app's logging setup decides what is shown (nothing below WARNING by default) and where
it goes; every event logged inside a request carries its ``request_id`` (bound with
contextvars). ``configure_logging`` is for programs that own the process: the CLI, the server.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# structlog imports rich (when installed) for its console renderer's tracebacks, 0.13 s of
# every process's start here; the renderers used below need none of it. Hidden only while
# structlog loads, and only when nothing has imported rich yet.
_HIDE_RICH = "rich" not in sys.modules
if _HIDE_RICH:
    sys.modules["rich"] = None  # type: ignore[assignment]
try:
    import structlog
finally:
    if _HIDE_RICH:
        del sys.modules["rich"]

_json_output = False
#: Events dropped while ``muted`` blocks run.
_muted: set[str] = set()


def _drop_muted(logger: Any, method: str, event: structlog.typing.EventDict) -> Any:
    if event.get("event") in _muted:
        raise structlog.DropEvent
    return event


@contextmanager
def muted(*events: str) -> Iterator[None]:
    """Drop the events named ``events`` (e.g. ``"request.failed"``) while the block runs: for
    a program that reports them itself, as ``mstar run`` reports a request's failure."""
    added = set(events) - _muted
    _muted.update(added)
    try:
        yield
    finally:
        _muted.difference_update(added)


def _render(logger: Any, method: str, event: structlog.typing.EventDict) -> str:
    if _json_output:
        return structlog.processors.JSONRenderer()(logger, method, event)  # type: ignore[return-value]
    name = event.pop("event")
    return structlog.processors.KeyValueRenderer(sort_keys=True)(
        logger, method, {"event": name, **event}
    )


def get_logger(name: str) -> Any:
    """A structlog logger for module ``name`` that writes through stdlib logging.

    Cheap when the level is off: events below the stdlib logger's level are dropped first.
    """
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.stdlib.filter_by_level,
            _drop_muted,
            structlog.contextvars.merge_contextvars,
            structlog.processors.TimeStamper(fmt="iso"),
            _render,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure_logging(level: str = "WARNING", *, json: bool = False) -> None:
    """Show mstar_async's events at ``level`` and above on stderr, as key=value text or JSON.

    Raises:
        ValueError: ``level`` is not a logging level name.
    """
    global _json_output
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be one of DEBUG, INFO, WARNING, ERROR; got {level!r}")
    _json_output = json
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger("mstar_async")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False
