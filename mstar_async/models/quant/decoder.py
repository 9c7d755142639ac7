"""Swapping a ``PagedDecoder``'s linears for ``QuantLinear``s while its weights are read.

Each layer's seven projections are read from the source (a GGUF file's blocks as they are, any
other weight as floats), brought into the scheme's layout (``fit``), fused as the float decoder
fuses them (q, k and v rows in one matrix; gate and up rows in another), packed, and installed
in the layer before the next layer is read, so no more than one layer's float weights is held
at a time. The head (``lm_head``, or the embedding it is tied to) may be quantized too; the
embedding, the norms and anything not quantized load as floats afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mstar_async.models.quant.kernels import require_kernels
from mstar_async.models.quant.linear import QuantLinear
from mstar_async.models.quant.weights import QuantizedWeight, fit

if TYPE_CHECKING:
    from mstar_async.models.checkpoints.streaming import TensorSource
    from mstar_async.models.llama import PagedDecoder

__all__ = ["FORMS", "QuantizedSource", "check_form", "quantize_linears"]

#: The quantized weight forms, by the names ``quantize=`` takes: the scheme of the layers'
#: linears and that of the head (``None``: the head stays in the float dtype).
FORMS: dict[str, tuple[str, str | None]] = {"int8": ("int8", "int8"), "int4": ("int4", "int8")}

# A layer's projections as the decoder runs them, fused: q/k/v, o, gate/up, down.
_FUSED = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

# The checkpoint names of one fused projection: its weights and its biases.
_Names = tuple[list[str], list[str]]


@runtime_checkable
class QuantizedSource(Protocol):
    """A ``TensorSource`` that can also give weights as stored codes (a GGUF file)."""

    def read_quantized(
        self, names: Sequence[str]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield each of ``names``, quantized ones as codes and scales."""
        ...


def check_form(quantize: str | None, device: torch.device | str) -> None:
    """Check up front that ``quantize`` (``None`` or a name of ``FORMS``) can run on
    ``device``. Never blocks.

    Raises:
        ValueError: ``quantize`` names no form.
        QuantizationUnsupported: this torch lacks a kernel the form needs on ``device``.
    """
    if quantize is None:
        return
    if quantize not in FORMS:
        raise ValueError(f"quantize must be one of {sorted(FORMS)} or None, got {quantize!r}")
    for scheme in FORMS[quantize]:
        if scheme is not None:
            require_kernels(scheme, device)


def quantize_linears(
    model: PagedDecoder,
    source: TensorSource,
    scheme: str,
    *,
    head: str | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> set[str]:
    """Replace every layer's projections of ``model`` (built on the meta device) with
    ``QuantLinear``s of ``scheme``, and its head with one of scheme ``head`` (``None`` keeps it
    for the float loading), reading their weights (and biases) from ``source``. Returns the
    checkpoint names it read, which the float loading must not expect to use again.

    Checks every name and shape before reading anything. Blocks on the reads (not
    cancel-safe: run it in a thread).

    Raises:
        ValueError: an unknown scheme; a weight missing from ``source`` or of another shape
            than the model's (the message lists them); a weight whose columns the int4 groups
            do not divide.
        QuantizationUnsupported: this torch has no kernel for a scheme on ``device``.
        Whatever ``source`` raises reading (``CheckpointError`` for a file).
    """
    for needed in {scheme, head} - {None}:
        require_kernels(str(needed), device)
    cfg = model.config
    plan: list[list[_Names]] = []  # per layer, per fused projection
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        plan.append(
            [
                (
                    [f"{prefix}{part}.weight" for part in parts],
                    [f"{prefix}{part}.bias" for part in parts if _has_bias(layer, part)],
                )
                for parts in _FUSED
            ]
        )
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    _check(model, source.shapes(), plan, head_name if head is not None else None)

    consumed: set[str] = set()
    layers = []
    for projections in plan:
        linears: list[QuantLinear] = []
        for weights, biases in projections:
            read = dict(_read(source, weights, scheme))
            weight = QuantizedWeight.cat([read[name] for name in weights])
            bias = _read_biases(source, biases)
            linears.append(QuantLinear(weight, bias, dtype=dtype, device=device))
            consumed.update(weights, biases)
        qkv, o_proj, gate_up, down_proj = linears
        layers.append((qkv, o_proj, gate_up, down_proj))
    quantized_head = None
    if head is not None:
        weight = dict(_read(source, [head_name], head))[head_name]
        quantized_head = QuantLinear(weight, None, dtype=dtype, device=device)
        if head_name == "lm_head.weight":
            consumed.add(head_name)
    model.use_quantized(layers, quantized_head)
    return consumed


def _has_bias(layer: torch.nn.Module, part: str) -> bool:
    return layer.get_submodule(part).bias is not None


def _check(
    model: PagedDecoder,
    shapes: Mapping[str, tuple[int, ...]],
    plan: Sequence[Sequence[_Names]],
    head_name: str | None,
) -> None:
    wanted = {
        name: _shape_in(model, name)
        for projections in plan
        for weights, biases in projections
        for name in (*weights, *biases)
    }
    if head_name is not None:
        wanted[head_name] = (model.config.vocab_size, model.config.hidden_size)
    missing = sorted(name for name in wanted if name not in shapes)
    wrong = sorted(
        f"{name}: checkpoint {shapes[name]}, model {shape}"
        for name, shape in wanted.items()
        if name in shapes and shapes[name] != shape
    )
    if missing or wrong:
        raise ValueError(
            "the checkpoint does not match the model: "
            f"missing keys {missing[:8]} ({len(missing)} in all), shape mismatches {wrong[:8]}"
        )


def _shape_in(model: PagedDecoder, name: str) -> tuple[int, ...]:
    module_name, _, attribute = name.rpartition(".")
    tensor = getattr(model.get_submodule(module_name), attribute)
    return tuple(tensor.shape)


def _read(
    source: TensorSource, names: Sequence[str], scheme: str
) -> Iterator[tuple[str, QuantizedWeight]]:
    # Each weight is fitted as soon as it is read: a source's tensor may be a view of a mapped
    # file that is valid only until the next one is yielded.
    tensors = (
        source.read_quantized(names) if isinstance(source, QuantizedSource) else source.read(names)
    )
    for name, tensor in tensors:
        yield name, fit(tensor, scheme)


def _read_biases(source: TensorSource, names: Sequence[str]) -> torch.Tensor | None:
    if not names:
        return None
    read = {name: tensor.to(torch.float32, copy=True) for name, tensor in source.read(names)}
    return torch.cat([read[name] for name in names])
