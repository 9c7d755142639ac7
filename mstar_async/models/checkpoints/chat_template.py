"""Rendering Hugging Face-style Jinja2 chat templates in a sandbox."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mstar_async.models.checkpoints.errors import CheckpointError


class ChatTemplateError(CheckpointError):
    """A chat template failed to compile, or called ``raise_exception`` while rendering."""


class ConversationRejected(ChatTemplateError, ValueError):
    """The template could not render this conversation: it called ``raise_exception``, or a
    message lacks a field it reads. The conversation is at fault, not the checkpoint, so this
    is also a ``ValueError`` (a server answers it as a bad request)."""


def _raise_exception(message: str) -> NoReturn:
    raise ConversationRejected(f"chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; templates written for transformers
    # expect plain JSON, so tool schemas render byte-for-byte the same here.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Same environment knobs transformers uses, so templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    **extra: Any,
) -> str:
    """Render chat template ``source`` for ``messages``.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
    any ``extra`` variables, and the helpers ``raise_exception`` and ``strftime_now``.
    Raises ``ChatTemplateError`` if the template does not compile, and its subclass
    ``ConversationRejected`` if it calls ``raise_exception`` or fails while rendering.
    """
    template = _compile(source)
    variables: dict[str, Any] = {
        **extra,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
    }
    try:
        return template.render(**variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        # A message without the field the template reads, or of a type it cannot handle.
        raise ConversationRejected(f"chat template failed while rendering: {exc}") from exc
