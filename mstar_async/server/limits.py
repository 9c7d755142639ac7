"""The limits a request must fit before it is admitted: one rule, which every route applies.

- Speech text (the ``text`` input of a model that speaks) carries at most the model's
  ``max_text_chars`` characters, per request and per websocket segment.
- A model that declares a ``ContextLimit``: the tokens it generates (``max_tokens``, given or
  the program's default) are at most its limit, and the prompt's tokens plus those fit in it.
  A request past it could never finish (its sequence cannot outgrow the positions or the whole
  KV cache), so it is refused at once instead of running until it fails. An empty prompt is
  refused too: there is nothing to continue.

Every refusal is a 400 in OpenAI's shape naming the request field at fault, its length and the
limit. A prompt of more characters than the context's tokens times the most characters one
token stands for is refused without being tokenized; any other is tokenized once (the program
encodes it again when it runs), on the event loop when short, on a worker thread when long, so
no request body, however large, holds the loop for long.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from mstar_async.graph import ContextLimit
from mstar_async.server.errors import APIError
from mstar_async.server.served import ServedModel

#: Program inputs that carry a request's prompt: the first given one is "the prompt" (a
#: conversation wins over a prompt, as the zoo's programs read them); with none given, the
#: first the program takes (its default).
PROMPT_INPUTS = ("messages", "prompt", "text")
_DEFAULT_PROMPT_INPUTS = ("prompt", "text", "messages")
#: OpenAI's code for a request longer than the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: Prompts of up to this many characters are counted on the event loop (about a millisecond);
#: longer ones on a worker thread.
INLINE_COUNT_CHARS = 16_384


@dataclass(frozen=True)
class FieldNames:
    """How a route's request names the program's inputs, for the ``param`` of a refusal: the
    ``renamed`` ones (``text`` is ``input`` on ``/v1/audio/speech``), the others as ``prefix``
    plus the input's name (``inputs.text`` on ``/generate``)."""

    renamed: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""

    def __call__(self, name: str) -> str:
        """The request field carrying program input ``name``."""
        return self.renamed.get(name, self.prefix + name)


#: A route whose request fields are named as the program's inputs.
SAME_NAMES = FieldNames()


async def check_limits(
    served: ServedModel, inputs: Mapping[str, Any], fields: FieldNames = SAME_NAMES
) -> None:
    """Refuse a request of ``served`` with program ``inputs`` that could never run; call it
    before any work or admission starts. Inputs of the wrong type are left to the program
    (or ``ProgramInputs``) to refuse. Cancel-safe (a count on a thread finishes there).

    Raises:
        APIError: 400 naming ``fields(input)``: speech text over ``max_text_chars``; for a
            model with a context limit, ``max_tokens`` over it, an empty prompt, a prompt that
            cannot be encoded, or prompt plus ``max_tokens`` over it
            (``code: "context_length_exceeded"``).
    """
    check_text_chars(served, inputs.get("text"), fields("text"))
    context = served.runtime.model.context
    if context is None:
        return
    budget = _budget(served, context, inputs, fields)
    name = _prompt_input(served, inputs)
    prompt = fields(name)
    chars = _chars(inputs.get(name))
    if context.token_chars is not None and chars > context.tokens * context.token_chars:
        raise APIError(
            400,
            f"{prompt} is {chars} characters, more than model {served.name!r} can take in "
            f"{context.tokens} tokens (at most {context.token_chars} characters a token): "
            f"shorten {prompt}",
            param=prompt,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    if chars <= INLINE_COUNT_CHARS:
        tokens = _count(context, inputs, prompt)
    else:
        tokens = await anyio.to_thread.run_sync(_count, context, inputs, prompt)
    if tokens == 0:
        raise APIError(400, f"{prompt} is empty: send at least one token", param=prompt)
    if tokens + budget <= context.tokens:
        return
    if context.generates is None:
        including, fix = "", f"shorten {prompt}"
    else:
        name = fields(context.generates)
        including, fix = f" including {name} ({budget})", f"shorten {prompt} or lower {name}"
    raise APIError(
        400,
        f"{prompt} is {tokens} tokens; model {served.name!r} takes at most {context.tokens} "
        f"tokens{including}: {fix}",
        param=prompt,
        code=CONTEXT_LENGTH_EXCEEDED,
    )


def check_text_chars(served: ServedModel, text: Any, param: str) -> None:
    """Refuse speech ``text`` longer than ``served.max_text_chars`` (only for a model that
    speaks; anything but a string is left to the program). Never suspends.

    Raises:
        APIError: 400 naming ``param``, the length and the limit.
    """
    if not served.speaks or not isinstance(text, str) or len(text) <= served.max_text_chars:
        return
    raise APIError(
        400,
        f"{param} is {len(text)} characters; model {served.name!r} speaks at most "
        f"{served.max_text_chars} characters a request: split the text (mstar serve "
        "--max-text-chars raises the limit)",
        param=param,
    )


def _budget(
    served: ServedModel, context: ContextLimit, inputs: Mapping[str, Any], fields: FieldNames
) -> int:
    """The tokens the request may generate (0 for a model that generates none)."""
    if context.generates is None:
        return 0
    value = inputs.get(context.generates, served.defaults.get(context.generates))
    if isinstance(value, bool) or not isinstance(value, int):
        return 0  # a wrong type: the program says so
    name = fields(context.generates)
    if value > context.tokens:
        raise APIError(
            400,
            f"{name} is {value}; model {served.name!r} takes at most {context.tokens} tokens "
            f"including the prompt: lower {name}",
            param=name,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return value


def _prompt_input(served: ServedModel, inputs: Mapping[str, Any]) -> str:
    given = [name for name in PROMPT_INPUTS if inputs.get(name) is not None]
    taken = [name for name in _DEFAULT_PROMPT_INPUTS if name in served.inputs]
    return (given or taken or ["prompt"])[0]


def _chars(value: Any, depth: int = 0) -> int:
    """The characters of the strings in a prompt input (a string, or a conversation of nested
    lists and objects); what is not text counts nothing."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:  # deeper than any conversation: the program refuses it
        return 0
    if isinstance(value, Mapping):
        return sum(_chars(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_chars(v, depth + 1) for v in value)
    return 0


def _count(context: ContextLimit, inputs: Mapping[str, Any], prompt: str) -> int:
    try:
        return context.count(inputs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"{prompt}: {exc}", param=prompt) from None
