"""Prefilling a spoken turn while it is spoken, so that its response computes only the tail.

While the user talks, the session asks the model to prefill the response's prompt as far as it
is known: the conversation so far, then the user's turn up to the encoder's last finished row
(rows of complete encoder windows; the last, partial window is only final at the commit). The
model keeps that prefix under the conversation's *warm* handle, and the turn's response resumes
from it or from the conversation's own kept KV, whichever shares more of its prompt (rows are
compared by content, so a warm prefix that is not a true prefix of the final prompt is simply
not used: it costs time, never correctness).

A ``Warmer`` runs at most one warm request of a session at a time. Wishes made while one runs
(the turn began being heard, the encoder finished a window, the conversation changed, a response
ended) coalesce into one more run after it, with what the session's ``prompt`` says then (None:
nothing to warm, as while a response runs or no turn is being heard). ``stop`` cancels the warm
in flight without waiting for it: what it computed stays warm for the response to resume from,
and the response never waits for it. ``discard`` also drops what was warmed once the request in
flight has released its KV (a cleared turn). A session's end cancels the warm request with the
session's other tasks; the model frees the warm handle with the conversation's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from mstar_async.realtime.config import SessionConfig


@dataclass(frozen=True)
class WarmTurn:
    """What to prefill: ``messages``, the conversation with the turn being spoken last (its
    ``"audio"`` the encoder rows finished so far, ``[n >= 0, hidden]``), for a response with
    the session's ``config``."""

    messages: list[dict[str, Any]]
    config: SessionConfig


#: Runs one warm request: ``(turn, request id)``; ``turn`` None drops what was warmed. Returns
#: when the request has ended and released its KV; never raises for a request the model
#: refused or failed (a warm is only ever worth some time).
Warm = Callable[[WarmTurn | None, str], Awaitable[None]]
#: What to warm now, or None for nothing.
Prompt = Callable[[], WarmTurn | None]


class Warmer:
    """At most one warm request of one session in flight (see the module docstring). Its
    methods are synchronous and never raise; the requests run in ``tg``, named
    ``{name}-{n}``."""

    def __init__(self, warm: Warm, tg: TaskGroup, prompt: Prompt, name: str) -> None:
        self._warm = warm
        self._tg = tg
        self._prompt = prompt
        self._name = name
        self._runs = 0
        self._wanted = False  # warm the turn as it stands, after what runs now
        self._dropping = False  # drop what was warmed, after what runs now
        self._warmed = False  # a warm ran since the last drop: the model may keep something
        self._running = False
        self._scope: anyio.CancelScope | None = None

    def want(self) -> None:
        """Warm the turn as it stands now, or, with a warm in flight, once it ends."""
        self._wanted = True
        self._start()

    def stop(self) -> None:
        """Cancel the warm in flight and any due; what was warmed stays (for a response to
        resume from). Does not wait for the request to end."""
        self._wanted = False
        if self._scope is not None:
            self._scope.cancel()

    def discard(self) -> None:
        """``stop``, then drop what was warmed once the request in flight has ended."""
        self.stop()
        if self._warmed:
            self._dropping = True
            self._start()

    def _start(self) -> None:
        if not self._running:
            self._running = True
            self._tg.start_soon(self._run)

    async def _run(self) -> None:
        try:
            while self._dropping or self._wanted:
                if self._dropping:  # before any new warm: it would keep under the same handle
                    self._dropping = self._warmed = False
                    await self._warm(None, f"{self._name}-drop")
                    continue
                self._wanted = False
                turn = self._prompt()
                if turn is None:
                    continue
                self._runs += 1
                self._warmed = True
                with anyio.CancelScope() as self._scope:
                    await self._warm(turn, f"{self._name}-{self._runs}")
                self._scope = None
        finally:
            self._scope = None
            self._running = False
