"""``/generate``'s JSON inputs as the values a model's program takes.

JSON carries strings, numbers, lists and objects; a program's parameters are annotated
(``text: str``, ``max_tokens: int``, ``messages: list[dict[str, str]] | None``,
``video: torch.Tensor | None``). Each input is checked against its annotation before the
request starts, so a wrong type is a 400 naming ``inputs.NAME`` and the type wanted rather
than whatever the program trips over later. A tensor input is built from nested lists of
numbers (as ``/generate`` sends latents and actions back); an image input (named in the model's
``info["image_inputs"]``) is decoded from base64 or a ``data:`` URL and never read from a path
(see ``media``). Inputs annotated ``Any``, or with a type JSON cannot describe, pass as they are.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from mstar_async.graph import Model
from mstar_async.server.errors import APIError
from mstar_async.server.media import decode_image

_AS_IS, _TENSOR, _IMAGE, _TYPED = "as is", "tensor", "image", "typed"


class ProgramInputs:
    """Converts JSON values to the inputs ``model``'s program takes (see the module docstring).

    Built once per served model: the program's annotations are read here.
    """

    def __init__(self, model: Model) -> None:
        hints = _annotations(model.program)
        images = set(model.info.get("image_inputs", ()))
        self._kinds: dict[str, tuple[str, Any]] = {
            name: (_IMAGE if name in images else _kind(hint), hint) for name, hint in hints.items()
        }

    def convert(self, given: Mapping[str, Any], *, prefix: str = "inputs.") -> dict[str, Any]:
        """``given`` as program inputs. Synchronous; never suspends.

        Raises:
            APIError: 400 naming ``prefix + name`` (and the path inside it) when a value does
                not fit its annotation, a tensor input is not nested lists of numbers, or an
                image input is not image data.
        """
        return {name: self._one(name, value, prefix + name) for name, value in given.items()}

    def _one(self, name: str, value: Any, param: str) -> Any:
        kind, hint = self._kinds.get(name, (_AS_IS, Any))
        if kind == _AS_IS or (value is None and kind != _TYPED):
            return value
        if kind == _IMAGE:
            return decode_image(value, param=param)
        if kind == _TENSOR:
            return _tensor(value, param)
        try:
            return msgspec.convert(value, hint, strict=True)
        except msgspec.ValidationError as exc:
            where, _, inside = str(exc).partition(" - at `$")
            path = param + inside.rstrip("`")
            raise APIError(400, f"{path}: {where}", param=path) from None


def _annotations(program: Callable[..., Any]) -> dict[str, Any]:
    """Each parameter's annotation, resolved one by one (as ``typing.get_type_hints`` does
    for all at once), so one that does not resolve (a name local to the builder) leaves only
    that input unchecked."""
    hints = {}
    for name, param in inspect.signature(program).parameters.items():
        hint = param.annotation
        if isinstance(hint, str):  # ``from __future__ import annotations``: our own source
            try:
                hint = eval(hint, getattr(program, "__globals__", {}))
            except Exception:
                hint = Any
        hints[name] = Any if hint is inspect.Parameter.empty else hint
    return hints


def _kind(hint: Any) -> str:
    if hint is Any:
        return _AS_IS
    if _mentions(hint, torch.Tensor):
        return _TENSOR
    try:
        info = msgspec.inspect.type_info(hint)
    except (TypeError, ValueError):  # a type msgspec cannot describe: the program checks it
        return _AS_IS
    return _AS_IS if _custom(info) else _TYPED


def _mentions(hint: Any, kind: type) -> bool:
    return hint is kind or any(_mentions(arg, kind) for arg in typing.get_args(hint))


def _custom(info: Any) -> bool:
    """Whether a type msgspec describes holds a class it cannot convert JSON into."""
    if isinstance(info, msgspec.inspect.CustomType):
        return True
    if isinstance(info, tuple):
        return any(_custom(item) for item in info)
    if isinstance(info, msgspec.inspect.Type):
        return any(_custom(getattr(info, f.name)) for f in msgspec.structs.fields(info))
    return False


def _tensor(value: Any, param: str) -> torch.Tensor:
    try:
        return torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise APIError(
            400, f"{param}: a tensor input is sent as nested lists of numbers", param=param
        ) from None
