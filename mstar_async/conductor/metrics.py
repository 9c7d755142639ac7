"""What one request cost and delivered: first-output latencies, audio length, tokens, outcome.

A ``RequestMetrics`` is filled by the conductor as the request's program yields outputs (the
times are when the program made each output, before it waits in the stream's buffer), and closed
when the request ends. Pure bookkeeping: no asyncio, no torch, so it is cheap per output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mstar_async.outputs import AudioChunk, TextDelta


@dataclass
class RequestMetrics:
    """Per-request figures, in seconds from the moment the request was started.

    ``ttfb`` is the time to the first output of any kind, ``ttfa`` to the first ``AudioChunk``,
    ``ttft`` to the first ``TextDelta``; each is None until that output exists. ``rtf`` is the
    end-to-end time over the seconds of audio made (below 1: faster than real time).
    ``prompt_tokens`` / ``completion_tokens`` are what the program reported (through
    ``RequestContext.record_usage`` or an output type carrying both counts), None if it reported
    nothing. Exactly one of ``finished``, ``cancelled``, ``failed`` is true once ``done``.
    """

    request_id: str
    started: float = field(default_factory=time.perf_counter, repr=False)
    ttfb: float | None = None
    ttfa: float | None = None
    ttft: float | None = None
    outputs: int = 0
    audio_seconds: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total: float | None = None
    finished: bool = False
    cancelled: bool = False
    failed: bool = False

    @property
    def done(self) -> bool:
        """Whether the request has ended (and ``total`` is set)."""
        return self.total is not None

    @property
    def rtf(self) -> float | None:
        """End-to-end seconds per second of audio; None before the end or without audio."""
        if self.total is None or self.audio_seconds <= 0:
            return None
        return self.total / self.audio_seconds

    def observe(self, output: Any) -> None:
        """Account for one output the program yielded, now."""
        self.outputs += 1
        audio = isinstance(output, AudioChunk)
        if audio:
            self.audio_seconds += output.seconds
        text = not audio and isinstance(output, TextDelta)
        if self.ttfb is None or (audio and self.ttfa is None) or (text and self.ttft is None):
            elapsed = time.perf_counter() - self.started
            self.ttfb = elapsed if self.ttfb is None else self.ttfb
            if audio and self.ttfa is None:
                self.ttfa = elapsed
            if text and self.ttft is None:
                self.ttft = elapsed
        if not (audio or text) and _reports_usage(output):
            prompt = getattr(output, "prompt_tokens", None)
            completion = getattr(output, "completion_tokens", None)
            if isinstance(prompt, int) and isinstance(completion, int):
                # An output that reports usage (a closing TextEnd) counts as the program's report.
                self.record_usage(prompt_tokens=prompt, completion_tokens=completion)

    def record_usage(
        self, *, prompt_tokens: int | None = None, completion_tokens: int | None = None
    ) -> None:
        """Set the token counts (a later report replaces an earlier one; None keeps a count).

        Raises:
            ValueError: a count is negative.
        """
        counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        for name, value in counts.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if completion_tokens is not None:
            self.completion_tokens = completion_tokens

    def close(self, *, cancelled: bool, failed: bool) -> None:
        """Record how the request ended, now; later calls change nothing."""
        if self.total is not None:
            return
        self.total = time.perf_counter() - self.started
        self.failed = failed
        self.cancelled = cancelled and not failed
        self.finished = not (self.cancelled or self.failed)

    def as_log(self) -> dict[str, Any]:
        """The figures as flat key/values for a structured log event (seconds rounded to 0.1 ms)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {
            "ttfb": ms(self.ttfb),
            "ttfa": ms(self.ttfa),
            "ttft": ms(self.ttft),
            "total": ms(self.total),
            "outputs": self.outputs,
            "audio_seconds": round(self.audio_seconds, 4),
            "rtf": ms(self.rtf),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "failed": self.failed,
        }


_USAGE_TYPES: dict[type, bool] = {}


def _reports_usage(output: Any) -> bool:
    # Asked once per output type: a failed attribute lookup per output costs more than the rest.
    kind = type(output)
    known = _USAGE_TYPES.get(kind)
    if known is None:
        known = _USAGE_TYPES[kind] = hasattr(output, "prompt_tokens") and hasattr(
            output, "completion_tokens"
        )
    return known
