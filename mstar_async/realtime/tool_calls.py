"""The Qwen family's tool-call format, parsed as the text streams.

The model writes a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
JSON on its own lines), as Qwen3's chat template asks of it. ``ToolCallParser`` passes other
text through as it comes, holds back only what may be the start of an opening tag, and turns
each complete call into a ``ParsedCall``. A call whose JSON does not parse, or names no
function, is passed through as text: the client sees what the model wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MAX_CALL_CHARS = 65_536


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A function call: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCallParser:
    """Feed text deltas with ``push``; end with ``flush``. Pure, synchronous, never raises."""

    def __init__(self) -> None:
        self._pending = ""  # text held back: a possible tag start, or a call being written
        self._in_call = False

    def push(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """The text to show now and the calls completed by ``delta``."""
        self._pending += delta
        shown: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    if len(self._pending) > MAX_CALL_CHARS:  # never closed: give it back as text
                        shown.append(OPEN + self._pending)
                        self._pending, self._in_call = "", False
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
                self._in_call = False
                call = _parse(body)
                if call is None:
                    shown.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                shown.append(self._pending[:start])
                self._pending = self._pending[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._pending)
            shown.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return "".join(shown), calls

    def flush(self) -> str:
        """What is still held back, as text (an unfinished call included)."""
        rest = (OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest


def _partial_tag(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def _parse(body: str) -> ParsedCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    return ParsedCall(
        data["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)
    )
