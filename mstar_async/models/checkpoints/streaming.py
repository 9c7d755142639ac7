"""Filling a module built on the meta device from a checkpoint, one tensor at a time.

A module is built with no storage (``empty_module``), then ``load_weights`` checks the whole
mapping of its parameters to checkpoint tensors before reading anything (check, then commit),
allocates each parameter once in its final dtype on its final device, and copies every
checkpoint tensor into it as the source yields it. Nothing holds a second copy of the weights: a
tensor read is dropped once copied, and a parameter stacked from several checkpoint tensors (a
mixture of experts' per-expert matrices) is filled slice by slice.

A parameter's place in the checkpoint is a list of ``Piece``s: a tensor name and the index of
the parameter it fills. The model says how its names map (a ``Layout``); this module only moves
bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "Layout",
    "LoadStats",
    "Piece",
    "StateDictSource",
    "TensorSource",
    "empty_module",
    "load_weights",
]

M = TypeVar("M", bound=nn.Module)

Index = tuple[int | slice, ...]


class TensorSource(Protocol):
    """Named tensors that can be listed without reading them, and read a few at a time."""

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor's name and shape; reads no tensor data."""
        ...

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each of ``names`` once, in the order the source reads fastest.

        A yielded tensor may be a view of a mapped file that stays valid only until the next one
        is yielded: copy it, do not keep it.
        """
        ...


class StateDictSource:
    """A ``TensorSource`` over tensors already in memory (a module's state dict)."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor's name and shape."""
        return {name: tuple(tensor.shape) for name, tensor in self._state.items()}

    def read(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each of ``names`` with its tensor.

        Raises:
            KeyError: a name the state dict lacks.
        """
        for name in names:
            yield name, self._state[name]


@dataclass(frozen=True, slots=True)
class Piece:
    """One checkpoint tensor, and the part of a parameter it fills (``()``: all of it)."""

    name: str
    index: Index = ()


#: Where a parameter's data is: ``(parameter name, shape) -> pieces``; the pieces cover every
#: element of the parameter exactly once.
Layout = Callable[[str, tuple[int, ...]], Sequence[Piece]]


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What one ``load_weights`` read: the checkpoint tensors (names in read order), their bytes
    as stored, and the wall time it took."""

    names: tuple[str, ...] = ()
    bytes: int = 0
    seconds: float = 0.0
    #: Bytes of the parameters this load allocated (in their final dtype).
    parameter_bytes: int = 0

    @property
    def tensors(self) -> int:
        """How many checkpoint tensors were read."""
        return len(self.names)


class _SkipInitialisers(TorchFunctionMode):
    # ``torch.nn.init`` on a meta tensor has nothing to fill, and torch 2.13 routes its normal_
    # through the compiler stack, whose import costs seconds and memory: skip the call.
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensors = (v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
            target = next(tensors, None)
            if target is not None and target.is_meta:
                return target
        return func(*args, **kwargs)


def empty_module(build: Callable[[], M]) -> M:
    """Call ``build`` with the meta device as the default, so the module it returns has
    parameters with shapes but no storage, and no time goes into initialising them.

    A module whose constructor makes tensors it keeps outside its parameters must give them an
    explicit device, or ``load_weights`` refuses the module. Raises whatever ``build`` raises.
    """
    with torch.device("meta"), _SkipInitialisers():
        return build()


def _fit(index: Index, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta")[index].shape)


@dataclass
class _Plan:
    params: dict[str, nn.Parameter]  # name -> parameter still on meta (each one once)
    targets: dict[str, list[tuple[str, Index]]]  # checkpoint name -> (parameter, index)


def _plan(
    module: nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    layout: Layout,
    claimed: Callable[[str], bool] | None,
) -> _Plan:
    params: dict[str, nn.Parameter] = {}
    targets: dict[str, list[tuple[str, Index]]] = {}
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []
    for name, param in module.named_parameters():  # tied parameters come once
        shape = tuple(param.shape)
        pieces = layout(name, shape)
        covered = 0
        for piece in pieces:
            used.add(piece.name)
            want = _fit(piece.index, shape)
            covered += math.prod(want)
            if piece.name not in shapes:
                missing.append(piece.name)
            elif shapes[piece.name] != want:
                wrong.append(f"{piece.name}: checkpoint {shapes[piece.name]}, model {want}")
            elif param.is_meta:
                targets.setdefault(piece.name, []).append((name, piece.index))
        if covered != math.prod(shape):
            raise ValueError(f"the layout's pieces of {name} cover {covered} of its elements")
        if param.is_meta:
            params[name] = param
    unexpected = sorted(n for n in shapes if claimed is not None and claimed(n) and n not in used)
    if missing or unexpected or wrong:
        raise ValueError(
            "the checkpoint does not match the model: "
            f"missing keys {sorted(missing)[:8]} ({len(missing)} in all), "
            f"unexpected keys {unexpected[:8]} ({len(unexpected)} in all), "
            f"shape mismatches {sorted(wrong)[:8]}"
        )
    return _Plan(params, targets)


def _replace(module: nn.Module, fresh: Mapping[int, nn.Parameter]) -> None:
    # By identity, so a parameter tied under two names stays one parameter.
    for owner in module.modules():
        for key, param in list(owner._parameters.items()):
            if param is not None and id(param) in fresh:
                owner.register_parameter(key, fresh[id(param)])


def _check_no_meta_tensors(module: nn.Module) -> None:
    # Loading fills parameters only; a buffer or plain tensor made on meta would stay empty.
    for owner_name, owner in module.named_modules():
        tensors = list(owner.named_buffers(recurse=False))
        tensors += [(k, v) for k, v in vars(owner).items() if isinstance(v, torch.Tensor)]
        for key, tensor in tensors:
            if tensor.is_meta:
                where = f"{owner_name}.{key}" if owner_name else key
                raise ValueError(
                    f"{where} is on the meta device and is not a parameter, so no checkpoint "
                    "tensor fills it: its module must make it with an explicit device"
                )


def load_weights(
    module: nn.Module,
    source: TensorSource,
    layout: Layout,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    claimed: Callable[[str], bool] | None = None,
) -> LoadStats:
    """Give every parameter of ``module`` still on the meta device its checkpoint values, in
    ``dtype`` (floating parameters; others keep their dtype) on ``device``.

    ``layout`` says which checkpoint tensors make each parameter. Parameters already
    materialised (a part shared with a module loaded earlier) are kept, and their checkpoint
    tensors are checked but not read. With ``claimed``, every checkpoint tensor it accepts must
    be used by some parameter (strict loading of one part of a larger checkpoint).

    Blocks for the reads (not cancel-safe: run it in a thread); on an error nothing of
    ``module`` has changed.

    Raises:
        ValueError: a tensor is missing, unexpected or of the wrong shape (the message lists
            them), or a buffer or plain tensor of ``module`` is on the meta device; both before
            anything is read.
        Whatever ``source`` raises reading (``CheckpointError`` for a folder).
    """
    started = time.perf_counter()
    _check_no_meta_tensors(module)
    plan = _plan(module, source.shapes(), layout, claimed)
    fresh: dict[str, torch.Tensor] = {
        name: torch.empty(
            param.shape,
            dtype=dtype if param.dtype.is_floating_point else param.dtype,
            device=device,
        )
        for name, param in plan.params.items()
    }
    names: list[str] = []
    read = 0
    with torch.no_grad():
        for name, tensor in source.read(list(plan.targets)):
            names.append(name)
            read += tensor.numel() * tensor.element_size()
            for param, index in plan.targets[name]:
                fresh[param][index].copy_(tensor)
            del tensor  # drop the mapped view before the next is read
    _replace(
        module,
        {
            id(param): nn.Parameter(fresh[name], requires_grad=False)
            for name, param in plan.params.items()
        },
    )
    return LoadStats(
        names=tuple(names),
        bytes=read,
        seconds=time.perf_counter() - started,
        parameter_bytes=sum(t.numel() * t.element_size() for t in fresh.values()),
    )
