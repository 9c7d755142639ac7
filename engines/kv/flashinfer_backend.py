"""Paged attention with FlashInfer's batch prefill/decode kernels (CUDA only).

``flashinfer`` is imported lazily, inside the functions below, so a CPU install never imports
it (nor needs it) when this module loads.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mstar_async.errors import EngineError

from .attention import AttentionBackend, AttentionMetadata, AttentionSpec
from .batch import BatchLayout

__all__ = [
    "FlashInferAttentionBackend",
    "FlashInferAttentionMetadata",
    "flashinfer_unsupported_reason",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
_DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer() -> Any:
    return importlib.import_module("flashinfer")


def flashinfer_unsupported_reason(device: torch.device | str, spec: AttentionSpec) -> str | None:
    """Return why FlashInfer cannot serve ``spec`` on ``device``, or ``None`` if it can.

    Imports ``flashinfer`` only when the device is CUDA and the spec is supported.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"device {dev} is not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if spec.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {spec.dtype} is not one of {_SUPPORTED_DTYPES}"
    if spec.head_dim not in _SUPPORTED_HEAD_DIMS:
        return f"head_dim {spec.head_dim} is not one of {_SUPPORTED_HEAD_DIMS}"
    try:
        _import_flashinfer()
    except Exception as exc:  # ImportError, or a broken CUDA/JIT setup raising at import
        return f"flashinfer does not import: {exc!r}"
    return None


@dataclass(frozen=True, eq=False)
class FlashInferAttentionMetadata(AttentionMetadata):
    """Metadata of :class:`FlashInferAttentionBackend`.

    Attributes:
        mode: which wrapper was planned (``"decode"`` when every query length is 1).
        plan_id: the backend's plan counter when this was planned; a later ``plan`` makes
            this metadata stale, because FlashInfer wrappers keep only their latest plan.
        owner: id of the backend that planned it.
    """

    mode: Literal["prefill", "decode"]
    plan_id: int
    owner: int


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (mixed and
    prefill batches, causal, bottom-right aligned for cached context) and
    ``BatchDecodeWithPagedKVCacheWrapper`` (all-decode batches), both in the NHD layout that
    :class:`PagedKVCache` stores (``[num_blocks, block_size, kv_heads, head_dim]`` per layer).
    """

    name = "flashinfer"

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        workspace_bytes: int = _DEFAULT_WORKSPACE_BYTES,
        use_tensor_cores: bool | None = None,
    ) -> None:
        """Create both wrappers over one zeroed workspace buffer on ``device``.

        ``use_tensor_cores`` (decode) defaults to ``True`` when more than 4 query heads share a
        KV head, where the tensor-core kernel is the faster one.

        Raises:
            EngineError: FlashInfer cannot serve ``spec`` on ``device`` (the message says why).
        """
        super().__init__(spec, device)
        reason = flashinfer_unsupported_reason(self.device, spec)
        if reason is not None:
            raise EngineError(f"FlashInfer backend unavailable: {reason}")
        fi = _import_flashinfer()
        if use_tensor_cores is None:
            use_tensor_cores = spec.group_size > 4
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=use_tensor_cores
        )
        self._plan_id = 0

    def plan(self, layout: BatchLayout) -> FlashInferAttentionMetadata:
        """Plan the decode wrapper (all query lengths 1) or the prefill wrapper (causal or not, as
        the layout says).

        Invalidates metadata from any earlier ``plan`` of this backend.

        Raises:
            EngineError: never for a valid layout.
        """
        spec, bs = self.spec, layout.block_size
        qo_indptr, kv_indptr = [0], [0]
        kv_indices: list[int] = []
        last_page_len: list[int] = []
        for table, ctx, q in zip(
            layout.block_tables, layout.context_lens, layout.query_lens, strict=True
        ):
            pages = math.ceil(ctx / bs)
            kv_indices.extend(table[:pages])
            kv_indptr.append(kv_indptr[-1] + pages)
            last_page_len.append(ctx - (pages - 1) * bs)
            qo_indptr.append(qo_indptr[-1] + q)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        mode: Literal["prefill", "decode"]
        if layout.is_decode_only:
            mode = "decode"
            self._decode.plan(
                i32(kv_indptr),
                i32(kv_indices),
                i32(last_page_len),
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                bs,
                q_data_type=spec.dtype,
                kv_data_type=spec.dtype,
                sm_scale=spec.softmax_scale,
            )
        else:
            mode = "prefill"
            self._prefill.plan(
                i32(qo_indptr),
                i32(kv_indptr),
                i32(kv_indices),
                i32(last_page_len),
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                bs,
                causal=layout.causal,
                sm_scale=spec.softmax_scale,
                q_data_type=spec.dtype,
                kv_data_type=spec.dtype,
            )
        self._plan_id += 1
        slots, positions = self._base_tensors(layout)
        return FlashInferAttentionMetadata(layout, slots, positions, mode, self._plan_id, id(self))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the planned wrapper on one layer; see :meth:`AttentionBackend.forward`.

        Raises:
            EngineError: ``meta`` is not this backend's latest plan, or shapes/dtypes mismatch.
        """
        if not isinstance(meta, FlashInferAttentionMetadata) or meta.owner != id(self):
            raise EngineError("metadata was not planned by this FlashInferAttentionBackend")
        if meta.plan_id != self._plan_id:
            raise EngineError(
                f"stale metadata: planned as #{meta.plan_id}, the backend's latest plan is "
                f"#{self._plan_id}"
            )
        self._check_forward(q, k_cache, v_cache, meta.layout)
        wrapper = self._decode if meta.mode == "decode" else self._prefill
        out: torch.Tensor = wrapper.run(q.contiguous(), (k_cache, v_cache))
        return out
