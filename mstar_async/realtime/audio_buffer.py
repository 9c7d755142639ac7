"""The input audio buffer of a realtime session: 16 kHz samples since the last commit or clear.

The session's timeline (what the VAD counts in) runs on across commits and clears:
``start`` is where the buffer's first sample sits on it, so a turn the VAD found at
``audio_end_ms`` ends ``end_ms * 16 - start`` samples into the buffer.
"""

from __future__ import annotations

import numpy as np

from mstar_async.realtime.events import RealtimeError
from mstar_async.realtime.vad import SAMPLE_RATE

#: Uncommitted input audio a session may hold: two minutes.
MAX_SAMPLES = 120 * SAMPLE_RATE


class AudioBuffer:
    """Samples appended, taken from the front. Synchronous."""

    __slots__ = ("_pieces", "samples", "start")

    def __init__(self) -> None:
        self._pieces: list[np.ndarray] = []
        self.samples = 0  # in the buffer
        self.start = 0  # session samples before the buffer's first

    def append(self, samples: np.ndarray) -> None:
        """Add samples at the end.

        Raises:
            RealtimeError: the buffer would hold more than two minutes (nothing is added).
        """
        if self.samples + samples.size > MAX_SAMPLES:
            raise RealtimeError(
                f"the input audio buffer holds {MAX_SAMPLES // SAMPLE_RATE} s at most; "
                "commit or clear it",
                code="input_audio_buffer_full",
                param="audio",
            )
        if samples.size:
            self._pieces.append(samples)
            self.samples += samples.size

    def take(self, count: int) -> np.ndarray:
        """The first ``count`` samples (fewer if the buffer holds fewer), removed."""
        audio = np.concatenate(self._pieces) if self._pieces else np.zeros(0, np.float32)
        taken, rest = audio[:count], audio[count:]
        self._pieces = [rest] if rest.size else []
        self.samples = int(rest.size)
        self.start += int(taken.size)
        return taken

    def samples_until(self, session_ms: int) -> int:
        """How many of the buffer's samples come before ``session_ms`` on the timeline
        (negative when that moment is before the buffer's start)."""
        return session_ms * SAMPLE_RATE // 1000 - self.start
