"""A realtime session's settings: what ``session.update`` may change, in either dialect.

GA clients nest audio settings (``session.audio.input.turn_detection``,
``session.audio.output.voice``, ``output_modalities``); beta clients send them flat
(``turn_detection``, ``voice``, ``modalities``, ``input_audio_format``). Both are read; fields
this server does not act on (tracing, truncation, transcription models, noise reduction) are
ignored, and so is a field sent as null (clients built on typed models send every optional field;
only ``turn_detection: null`` means something: commit by hand). Audio is pcm16 at 24 kHz both ways,
at speed 1.0, in one of the model's voices: anything else is refused with an error naming the
field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mstar_async.realtime.events import RealtimeError
from mstar_async.realtime.turns import TurnDetection

CLIENT_RATE = 24_000
MAX_INSTRUCTIONS_CHARS = 16_384
MAX_TOOLS = 64
MAX_OUTPUT_TOKENS = 4096


@dataclass(frozen=True)
class SessionConfig:
    """The settings one session runs with; ``update`` returns a changed copy."""

    modalities: tuple[str, ...] = ("text", "audio")
    instructions: str = ""
    voice: str | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    temperature: float = 0.8
    max_output_tokens: int = 256
    #: The model's voices (lower case); empty: any name is taken. Not sent to clients.
    voices: tuple[str, ...] = ()

    @property
    def speaks(self) -> bool:
        """Whether responses carry audio."""
        return "audio" in self.modalities

    def update(self, session: Any) -> SessionConfig:
        """A copy with the fields ``session`` (a ``session.update``'s object) sets.

        Raises:
            RealtimeError: a field has a bad value (names it and what it takes).
        """
        if not isinstance(session, dict):
            raise RealtimeError("'session' must be an object", param="session")
        if session.get("type", "realtime") not in ("realtime", None):
            raise RealtimeError(
                f"session.type {session['type']!r} is not served; this route holds 'realtime' "
                "sessions (no transcription-only sessions)",
                param="session.type",
                code="unsupported_value",
            )
        changes: dict[str, Any] = {}
        session = _given(session)
        audio = _object(session, "audio")
        audio_in, audio_out = _object(audio, "input", "audio"), _object(audio, "output", "audio")
        audio_in, audio_out = _given(audio_in), _given(audio_out)
        for name in ("output_modalities", "modalities"):
            if name in session:
                changes["modalities"] = _modalities(session[name], name)
        if "instructions" in session:
            changes["instructions"] = _text(session["instructions"], "instructions")
        for where, key, param in (
            (session, "voice", "voice"),
            (audio_out, "voice", "audio.output.voice"),
        ):
            if key in where and where[key] is not None:
                changes["voice"] = self._voice(_voice_name(where[key], param), param)
        for where, param in ((session, "speed"), (audio_out, "audio.output.speed")):
            speed = where.get(param.rsplit(".", 1)[-1])
            if speed is not None and speed != 1.0:
                raise RealtimeError(
                    f"{param}: only speed 1.0 is served (the model has no speed control), "
                    f"got {speed!r}",
                    param=param,
                    code="unsupported_value",
                )
        for where, key, param in (
            (session, "turn_detection", "turn_detection"),
            (audio_in, "turn_detection", "audio.input.turn_detection"),
        ):
            if key in where:
                changes["turn_detection"] = _turn_detection(where[key], param)
        for where, key, param in (
            (session, "input_audio_format", "input_audio_format"),
            (session, "output_audio_format", "output_audio_format"),
            (audio_in, "format", "audio.input.format"),
            (audio_out, "format", "audio.output.format"),
        ):
            if key in where:
                _check_format(where[key], param)
        if "tools" in session:
            changes["tools"] = _tools(session["tools"])
        if "tool_choice" in session:
            changes["tool_choice"] = _tool_choice(session["tool_choice"])
        if "temperature" in session:
            changes["temperature"] = _number(session["temperature"], "temperature", 0.0, 2.0)
        for name in ("max_output_tokens", "max_response_output_tokens"):
            if name in session:
                changes["max_output_tokens"] = max_tokens(session[name], name)
        return replace(self, **changes)

    def _voice(self, name: str, param: str) -> str:
        if self.voices and name.lower() not in self.voices:
            raise RealtimeError(
                f"{param}: the model has no voice {name!r}; its voices: {', '.join(self.voices)}",
                param=param,
            )
        return name.lower() if self.voices else name

    def as_json(self, *, beta: bool, session_id: str, model: str) -> dict[str, Any]:
        """The session object ``session.created`` / ``session.updated`` carry."""
        detection = _detection_json(self.turn_detection)
        common = {
            "id": session_id,
            "object": "realtime.session",
            "model": model,
            "instructions": self.instructions,
            "tools": list(self.tools),
            "tool_choice": self.tool_choice,
        }
        if beta:
            return {
                **common,
                "modalities": list(self.modalities),
                "voice": self.voice,
                "input_audio_format": "pcm16",
                "output_audio_format": "pcm16",
                "turn_detection": detection,
                "temperature": self.temperature,
                "max_response_output_tokens": self.max_output_tokens,
            }
        pcm = {"type": "audio/pcm", "rate": CLIENT_RATE}
        return {
            **common,
            "type": "realtime",
            "output_modalities": list(self.modalities),
            "audio": {
                "input": {"format": pcm, "turn_detection": detection},
                "output": {"format": pcm, "voice": self.voice},
            },
            "max_output_tokens": self.max_output_tokens,
        }


def max_tokens(value: Any, param: str) -> int:
    """``max_output_tokens``: an int in [1, 4096] or ``"inf"`` (the most, 4096).

    Raises:
        RealtimeError: anything else.
    """
    if value == "inf":
        return MAX_OUTPUT_TOKENS
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_OUTPUT_TOKENS:
        return value
    raise RealtimeError(
        f"{param} must be an integer in [1, {MAX_OUTPUT_TOKENS}] or 'inf'", param=param
    )


def _given(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without those sent as null, but for ``turn_detection`` (null: turned off)."""
    return {k: v for k, v in fields.items() if v is not None or k == "turn_detection"}


def _voice_name(value: Any, param: str) -> str:
    """A voice given as a name or as ``{"id": name}``."""
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        value = value["id"]
    return _text(value, param, limit=64)


def _object(parent: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RealtimeError(f"'{prefix + '.' if prefix else ''}{key}' must be an object", param=key)
    return value


def _text(value: Any, param: str, limit: int = MAX_INSTRUCTIONS_CHARS) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise RealtimeError(f"{param} must be a string of at most {limit} characters", param=param)
    return value


def _number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RealtimeError(f"{param} must be a number in [{low}, {high}]", param=param)
    return float(value)


def _modalities(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise RealtimeError(
            f"{param} must be ['text'], ['audio'] or ['text', 'audio']", param=param
        )
    # Audio replies always carry their transcript, so "audio" implies the text.
    return ("text", "audio") if "audio" in value else ("text",)


def _turn_detection(value: Any, param: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type", "server_vad") != "server_vad":
        kind = value.get("type") if isinstance(value, dict) else value
        raise RealtimeError(
            f"{param}: only type 'server_vad' (or null, to commit by hand) is served, got {kind!r}",
            param=param,
            code="unsupported_value",
        )
    fields = {
        k: value[k]
        for k in ("threshold", "prefix_padding_ms", "silence_duration_ms")
        if value.get(k) is not None
    }
    flags = {
        k: value[k] for k in ("create_response", "interrupt_response") if value.get(k) is not None
    }
    for key, flag in flags.items():
        if not isinstance(flag, bool):
            raise RealtimeError(f"{param}.{key} must be true or false", param=f"{param}.{key}")
    try:
        if "threshold" in fields:
            fields["threshold"] = _number(fields["threshold"], f"{param}.threshold", 0.0, 1.0)
        for key in ("prefix_padding_ms", "silence_duration_ms"):
            if key in fields and (
                isinstance(fields[key], bool) or not isinstance(fields[key], int)
            ):
                raise RealtimeError(f"{param}.{key} must be an integer", param=f"{param}.{key}")
        return TurnDetection(**fields, **flags)
    except ValueError as exc:
        raise RealtimeError(str(exc), param=param) from None


def _check_format(value: Any, param: str) -> None:
    if value == "pcm16":
        return
    if (
        isinstance(value, dict)
        and value.get("type") == "audio/pcm"
        and value.get("rate", CLIENT_RATE) == CLIENT_RATE
    ):
        return
    raise RealtimeError(
        f"{param}: only pcm16 at {CLIENT_RATE} Hz is served ('pcm16', or "
        f"{{'type': 'audio/pcm', 'rate': {CLIENT_RATE}}}), got {value!r}",
        param=param,
        code="unsupported_value",
    )


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RealtimeError(f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    tools = []
    for i, tool in enumerate(value):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("name"), str)
            or not tool["name"]
        ):
            raise RealtimeError(
                f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}}",
                param=f"tools[{i}]",
            )
        tools.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": str(tool.get("description", "")),
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            }
        )
    return tuple(tools)


def _tool_choice(value: Any) -> str:
    if value in ("auto", "none", "required"):
        return str(value)
    raise RealtimeError("tool_choice must be 'auto', 'none' or 'required'", param="tool_choice")


def _detection_json(detection: TurnDetection | None) -> dict[str, Any] | None:
    if detection is None:
        return None
    return {
        "type": "server_vad",
        "threshold": detection.threshold,
        "prefix_padding_ms": detection.prefix_padding_ms,
        "silence_duration_ms": detection.silence_duration_ms,
        "create_response": detection.create_response,
        "interrupt_response": detection.interrupt_response,
    }
