"""Server VAD turn detection: speech probabilities per frame in, speech started/stopped out.

The Realtime API's ``server_vad``: speech starts on the first frame whose probability reaches
``threshold``; the turn's audio begins ``prefix_padding_ms`` earlier (never before the start
of the buffer). Speech stops once the probability has stayed below the release level for
``silence_duration_ms``; the stop is reported at that moment, so the turn's audio includes the
silence. The release level is ``threshold - 0.15`` (at least 0.01), the hysteresis Silero's own
iterator uses, so a probability that wavers around the threshold does not end a turn.
"""

from __future__ import annotations

from dataclasses import dataclass

HYSTERESIS = 0.15


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """``server_vad`` settings, with the Realtime API's defaults.

    Raises:
        ValueError: ``threshold`` outside [0, 1] or a negative duration (names the field).
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"turn_detection.threshold must be in [0, 1], got {self.threshold}")
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            value = getattr(self, name)
            if not 0 <= value <= 10_000:
                raise ValueError(f"turn_detection.{name} must be in [0, 10000], got {value}")

    @property
    def release(self) -> float:
        """The probability under which a frame counts as silence once speech has started."""
        return max(0.01, self.threshold - HYSTERESIS)


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Speech began: the turn's audio starts at ``audio_start_ms`` (prefix padding included)."""

    audio_start_ms: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """Speech ended: the turn's audio ends at ``audio_end_ms`` (the silence included)."""

    audio_end_ms: int


TurnEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """Follows one stream's frames; ``frame(probability)`` returns the event it completes.

    ``frame_ms`` is the length of one frame (32 ms for Silero at 16 kHz). Times count from
    the first frame. Pure, synchronous, never raises.
    """

    __slots__ = ("_below_ms", "_elapsed_ms", "frame_ms", "settings", "speaking")

    def __init__(self, settings: TurnDetection, frame_ms: float) -> None:
        self.settings = settings
        self.frame_ms = frame_ms
        self.speaking = False
        self._elapsed_ms = 0.0  # end of the last frame seen
        self._below_ms = 0.0  # silence since speech was last heard

    @property
    def elapsed_ms(self) -> int:
        """How much audio the detector has seen."""
        return round(self._elapsed_ms)

    def frame(self, probability: float) -> TurnEvent | None:
        """One more frame's speech probability; the event it completes, if any."""
        start = self._elapsed_ms
        self._elapsed_ms += self.frame_ms
        settings = self.settings
        if not self.speaking:
            if probability >= settings.threshold:
                self.speaking = True
                self._below_ms = 0.0
                return SpeechStarted(max(0, round(start - settings.prefix_padding_ms)))
            return None
        if probability >= settings.release:
            self._below_ms = 0.0
            return None
        self._below_ms += self.frame_ms
        if self._below_ms >= settings.silence_duration_ms:
            self.speaking = False
            self._below_ms = 0.0
            return SpeechStopped(round(self._elapsed_ms))
        return None

    def reset(self) -> None:
        """Forget a turn in progress (the input buffer was cleared); time goes on."""
        self.speaking = False
        self._below_ms = 0.0
