"""A quantized decoder's packed weights kept on disk, so a later start skips the GGUF work.

Turning GGUF blocks into kernel-ready buffers (unpacking 4-bit codes, then packing them again
in the tile order ``_convert_weight_to_int4pack_for_cpu`` wants) costs seconds of CPU for
SmolLM2-135M, most of a cold start; reading the finished buffers back is one safetensors read.
The file is keyed by everything its bytes depend on: the GGUF's path, size and modification
time, the form, the dtype, torch's version (it owns the packing layout) and the machine's
architecture. A file that cannot be used is ignored (and rewritten), never trusted half-way.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mstar_async.models.checkpoints.errors import CheckpointError
from mstar_async.models.checkpoints.streaming import (
    Piece,
    StateDictSource,
    empty_module,
    load_weights,
)
from mstar_async.models.quant.linear import QuantLinear

if TYPE_CHECKING:
    from mstar_async.models.llama import PagedDecoder

__all__ = ["cached_quantized", "load_packed", "packed_path", "save_packed"]

log = structlog.get_logger(__name__)

# Bumped whenever what is stored, or how it is named, changes.
_FORMAT = 1

# A decoder layer's quantized linears, in the order ``PagedDecoder.use_quantized`` takes them.
_LAYER_LINEARS = ("qkv_proj", "self_attn.o_proj", "gate_up_proj", "mlp.down_proj")


def packed_path(gguf: Path, form: str, dtype: torch.dtype, cache_dir: Path) -> Path:
    """Where the packed ``form`` of ``gguf`` in ``dtype`` lives under ``cache_dir``.

    Raises:
        OSError: ``gguf`` cannot be stat'ed.
    """
    stat = gguf.stat()
    key = "|".join(
        str(part)
        for part in (
            gguf.resolve(),
            stat.st_size,
            stat.st_mtime_ns,
            form,
            dtype,
            torch.__version__,
            platform.machine(),
            _FORMAT,
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "packed" / f"{gguf.stem}-{form}-{digest}.safetensors"


def save_packed(model: PagedDecoder, path: Path) -> None:
    """Write ``model``'s buffers and parameters to ``path`` atomically (a reader sees the old
    file or the whole new one). Blocks on the write.

    Raises:
        OSError: the file cannot be written.
    """
    modules = {
        name: [module.scheme, module.in_features, module.out_features]
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear)
    }
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the embedding itself
        tensors[name] = tensor.detach().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, partial, metadata={"modules": json.dumps(modules)})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_packed(
    config: Mapping[str, Any], path: Path, *, dtype: torch.dtype, device: str
) -> PagedDecoder:
    """The decoder ``save_packed`` wrote to ``path``, for the checkpoint ``config`` describes.
    Blocks on the read.

    Raises:
        CheckpointError: the file is missing, unreadable, or does not hold this decoder's
            packed weights in ``dtype`` (the message says what differs).
    """
    # Imported here: the decoder module imports this package.
    from mstar_async.models.llama import DecoderConfig, PagedDecoder

    cfg = DecoderConfig.from_hf(config)
    try:
        with safe_open(str(path), "pt", device=device) as handle:
            modules = json.loads((handle.metadata() or {})["modules"])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, SafetensorError, KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"packed weights {path} are unreadable: {exc}") from exc
    try:
        model = empty_module(lambda: PagedDecoder(cfg))

        def linear(name: str) -> QuantLinear:
            scheme, in_features, out_features = modules[name]
            scales = tensors.pop(f"{name}.scales")
            if scales.dtype != dtype:
                raise ValueError(f"{name} has {scales.dtype} scales, not {dtype}")
            return QuantLinear.from_packed(
                scheme,
                in_features,
                out_features,
                packed=tensors.pop(f"{name}.packed"),
                scales=scales,
                bias=tensors.pop(f"{name}.bias", None),
            )

        layers = [
            tuple(linear(f"model.layers.{index}.{part}") for part in _LAYER_LINEARS)
            for index in range(cfg.num_hidden_layers)
        ]
        head = linear("lm_head") if "lm_head" in modules else None
        model.use_quantized(layers, head)  # type: ignore[arg-type]
        source = StateDictSource(tensors)
        load_weights(model, source, lambda name, _: [Piece(name)], dtype=dtype, device=device)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"packed weights {path} do not fit this decoder: {exc}") from exc
    return model.eval()


def cached_quantized(
    config: Mapping[str, Any],
    path: Path,
    build: Callable[[], PagedDecoder],
    *,
    dtype: torch.dtype,
    device: str,
) -> PagedDecoder:
    """The decoder packed at ``path`` if that file is usable, else ``build()``'s, which is then
    written there for the next start (a failed write only costs that). Blocks; not cancel-safe
    (run it in a thread).

    Raises:
        Whatever ``build`` raises.
    """
    if path.is_file():
        try:
            return load_packed(config, path, dtype=dtype, device=device)
        except CheckpointError as exc:
            log.warning("packed_weights_unusable", path=str(path), error=str(exc))
    model = build()
    try:
        save_packed(model, path)
    except OSError as exc:
        log.warning("packed_weights_not_saved", path=str(path), error=str(exc))
    return model
