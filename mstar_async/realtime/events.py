"""Server events of the OpenAI Realtime API, in the generally available names or the beta ones.

A client that connects with the header ``OpenAI-Beta: realtime=v1`` speaks the beta protocol;
it gets the beta names where they differ (``response.audio.delta`` for
``response.output_audio.delta``, one ``conversation.item.created`` where the GA protocol sends
``conversation.item.added`` and later ``conversation.item.done``). Everything else is shared.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

#: GA server event names -> the beta names where they differ.
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
#: GA events the beta protocol does not have.
BETA_OMITS = frozenset({"conversation.item.done"})


def new_id(prefix: str) -> str:
    """A fresh id such as ``item_3f9a...`` (the API's ids are opaque strings)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class EventNames:
    """Stamps server events with an ``event_id`` and the dialect's name. Never raises."""

    def __init__(self, beta: bool) -> None:
        self.beta = beta
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    def event(self, name: str, /, **fields: Any) -> dict[str, Any] | None:
        """The event ``name`` with ``fields``; ``None`` where the dialect has no such event."""
        if self.beta:
            if name in BETA_OMITS:
                return None
            name = BETA_NAMES.get(name, name)
        return {"type": name, "event_id": f"event_{self._prefix}{next(self._ids)}", **fields}


class RealtimeError(Exception):
    """A client event the session refuses: sent back as an ``error`` event, the session goes on.

    ``code`` is a short machine name, ``param`` the offending field (if one), ``event_id`` the
    client event's id (if it gave one).
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        event_id: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.event_id = event_id
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """The ``error`` object of the event."""
        return {
            "type": self.kind,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "event_id": self.event_id,
        }
