"""Portable paged attention: gather pages, then ``scaled_dot_product_attention``. Any device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from mstar_async.errors import EngineError

from .attention import AttentionBackend, AttentionMetadata, AttentionSpec
from .batch import BatchLayout

__all__ = ["TorchAttentionBackend", "TorchAttentionMetadata"]

# ``enable_gqa`` arrived in torch 2.5; older torch repeats K/V per query head instead.
_HAS_ENABLE_GQA = TorchVersion(torch.__version__) >= "2.5"


@dataclass(frozen=True, eq=False)
class _Group:
    # Why padded groups: one SDPA call over a padded [seqs, heads, rows, keys] batch replaces a
    # Python loop of per-sequence calls. Decode sequences always share one group (the common
    # case at scale); prefill sequences share one only when padding wastes little (see
    # ``pad_waste_limit``), else each gets its own, unpadded, group.
    num_seqs: int
    max_q: int  # padded query rows per sequence
    blocks_per_seq: int  # padded blocks per sequence
    key_len: int  # keys actually attended (longest context in the group)
    block_index: torch.Tensor  # [num_seqs * blocks_per_seq] int64 block ids, padding repeats
    q_start: int  # first flat q row when the group's rows are contiguous and unpadded
    q_rows: torch.Tensor | None  # [num_seqs * max_q] flat q row per padded row, or None
    out_rows: torch.Tensor | None  # [valid rows] flat output row of each real row, or None
    out_src: torch.Tensor | None  # [valid rows] padded row each real row comes from, or None
    mask: torch.Tensor | None  # additive [num_seqs, 1, max_q, key_len] in spec dtype, or None
    is_causal: bool  # top-left causal without a mask (one sequence whose queries are all keys)


@dataclass(frozen=True, eq=False)
class TorchAttentionMetadata(AttentionMetadata):
    """Metadata of :class:`TorchAttentionBackend`: the padded groups each layer runs.

    Attributes:
        groups: the SDPA calls one layer makes, in order.
        owner: id of the backend that planned it.
    """

    groups: tuple[_Group, ...]
    owner: int


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch: gather each sequence's blocks, then one SDPA per group.

    Pages are gathered block by block (``index_select`` of whole blocks) into workspace buffers
    that are kept and reused across layers and steps; that avoids a fresh allocation (and, on
    CPU, page faults) per layer, which measured ~3.5x faster than gathering into new tensors.
    Decode groups fold the query heads of each KV head into the query-row axis
    (``[seqs, kv_heads, group, dim]``), so GQA needs no K/V repeat and the key-padding mask
    broadcasts over all rows.
    """

    name = "torch"

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str, *, pad_waste_limit: float = 2.0
    ) -> None:
        """Create the backend.

        ``pad_waste_limit`` decides when prefill sequences share one padded SDPA call: when
        ``seqs * max_q * max_keys <= pad_waste_limit * sum(q * keys)``; ``math.inf`` always
        pads, ``1.0`` pads only when it wastes nothing.

        Raises:
            ValueError: ``pad_waste_limit`` is below 1.
        """
        super().__init__(spec, device)
        if not pad_waste_limit >= 1.0:
            raise ValueError(f"pad_waste_limit must be >= 1, got {pad_waste_limit!r}")
        self.pad_waste_limit = pad_waste_limit
        self._workspace: list[torch.Tensor | None] = [None, None]

    # ------------------------------------------------------------------ plan

    def plan(self, layout: BatchLayout) -> TorchAttentionMetadata:
        """Precompute gather indices, row maps and masks for one batch.

        Raises:
            EngineError: never for a valid layout (layouts validate themselves).
        """
        slots, positions = self._base_tensors(layout)
        decode = [i for i, q in enumerate(layout.query_lens) if q == 1]
        prefill = [i for i, q in enumerate(layout.query_lens) if q > 1]
        index_groups: list[list[int]] = [decode] if decode else []
        if prefill:
            bs = layout.block_size
            max_q = max(layout.query_lens[i] for i in prefill)
            max_k = max(layout.context_lens[i] for i in prefill)
            exact = sum(layout.query_lens[i] * layout.context_lens[i] for i in prefill)
            padded = len(prefill) * max_q * math.ceil(max_k / bs) * bs
            if padded <= self.pad_waste_limit * exact:
                index_groups.append(prefill)
            else:
                index_groups.extend([i] for i in prefill)
        q_offsets = [0]
        for q in layout.query_lens:
            q_offsets.append(q_offsets[-1] + q)
        groups = tuple(self._group(layout, idx, q_offsets) for idx in index_groups)
        return TorchAttentionMetadata(layout, slots, positions, groups, id(self))

    def _group(self, layout: BatchLayout, idx: list[int], q_offsets: list[int]) -> _Group:
        bs = layout.block_size
        qs = [layout.query_lens[i] for i in idx]
        ls = [layout.context_lens[i] for i in idx]
        max_q, key_len = max(qs), max(ls)
        blocks_per_seq = math.ceil(key_len / bs)
        block_index: list[int] = []
        for i, ctx in zip(idx, ls, strict=True):
            table = layout.block_tables[i][: math.ceil(ctx / bs)]
            block_index.extend(table)
            block_index.extend([table[0]] * (blocks_per_seq - len(table)))
        contiguous = all(q == max_q for q in qs) and idx == list(range(idx[0], idx[-1] + 1))
        q_rows = out_rows = out_src = None
        if not contiguous:
            rows = [
                q_offsets[i] + min(r, q - 1)
                for i, q in zip(idx, qs, strict=True)
                for r in range(max_q)
            ]
            real = [q_offsets[i] + r for i, q in zip(idx, qs, strict=True) for r in range(q)]
            src = [b * max_q + r for b, q in enumerate(qs) for r in range(q)]
            q_rows, out_rows, out_src = (self._long(x) for x in (rows, real, src))
        mask: torch.Tensor | None = None
        is_causal = False
        if not layout.causal:
            if any(c != key_len for c in ls):
                # Queries see their whole sequence; only keys past its end are masked.
                lens = torch.tensor(ls, device=self.device).view(-1, 1, 1)
                key = torch.arange(key_len, device=self.device).view(1, 1, -1)
                visible = (key < lens).expand(-1, max_q, -1)
                mask = torch.zeros(visible.shape, dtype=self.spec.dtype, device=self.device)
                mask.masked_fill_(~visible, float("-inf"))
                mask = mask.unsqueeze(1)
        elif len(idx) == 1 and qs[0] == ls[0] and max_q > 1:
            is_causal = True  # a fresh prefill: top-left causal is exactly right
        elif not (max_q == 1 and all(c == key_len for c in ls)):
            lens = torch.tensor(ls, device=self.device).view(-1, 1, 1)
            qlen = torch.tensor(qs, device=self.device).view(-1, 1, 1)
            row = torch.arange(max_q, device=self.device).view(1, -1, 1)
            key = torch.arange(key_len, device=self.device).view(1, 1, -1)
            # Padded rows (row >= q) copy the last real row's window, so no row is all -inf.
            visible = key <= lens - qlen + torch.minimum(row, qlen - 1)
            mask = torch.zeros(visible.shape, dtype=self.spec.dtype, device=self.device)
            mask.masked_fill_(~visible, float("-inf"))
            mask = mask.unsqueeze(1)
        return _Group(
            num_seqs=len(idx),
            max_q=max_q,
            blocks_per_seq=blocks_per_seq,
            key_len=key_len,
            block_index=self._long(block_index),
            q_start=q_offsets[idx[0]],
            q_rows=q_rows,
            out_rows=out_rows,
            out_src=out_src,
            mask=mask,
            is_causal=is_causal,
        )

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend ``q`` to one layer's paged K/V; see :meth:`AttentionBackend.forward`.

        Raises:
            EngineError: ``meta`` was not planned by this backend, or shapes/dtypes mismatch.
        """
        if not isinstance(meta, TorchAttentionMetadata) or meta.owner != id(self):
            raise EngineError("metadata was not planned by this TorchAttentionBackend")
        self._check_forward(q, k_cache, v_cache, meta.layout)
        total = q.shape[0]
        outputs = [(g, self._run_group(q, k_cache, v_cache, g)) for g in meta.groups]
        if len(outputs) == 1 and outputs[0][0].out_rows is None:
            return outputs[0][1]  # one group holding every row in order: already flat
        out = q.new_empty(total, self.spec.num_heads, self.spec.head_dim)
        for g, o in outputs:
            if g.out_rows is None:
                out[g.q_start : g.q_start + o.shape[0]].copy_(o)
            else:
                assert g.out_src is not None
                out.index_copy_(0, g.out_rows, o.index_select(0, g.out_src))
        return out

    def _run_group(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group
    ) -> torch.Tensor:
        spec = self.spec
        h, hkv, d, group = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group_size
        rows = g.num_seqs * g.max_q
        k = self._gather(0, k_cache, g)
        v = self._gather(1, v_cache, g)
        qg = q[g.q_start : g.q_start + rows] if g.q_rows is None else q.index_select(0, g.q_rows)
        if g.max_q == 1:
            # Decode: head h = kv_head * group + j, so [seqs, 1, h, d] views as
            # [seqs, kv_heads, group, d]: each KV head's query heads become its query rows.
            o = F.scaled_dot_product_attention(
                qg.view(g.num_seqs, hkv, group, d),
                k,
                v,
                attn_mask=g.mask,
                scale=spec.softmax_scale,
            )
            return o.reshape(rows, h, d)
        qt = qg.view(g.num_seqs, g.max_q, h, d).transpose(1, 2)
        if group > 1 and not _HAS_ENABLE_GQA:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        kwargs = {"enable_gqa": True} if group > 1 and _HAS_ENABLE_GQA else {}
        o = F.scaled_dot_product_attention(
            qt, k, v, attn_mask=g.mask, is_causal=g.is_causal, scale=spec.softmax_scale, **kwargs
        )
        return o.transpose(1, 2).reshape(rows, h, d)

    def _gather(self, which: int, cache: torch.Tensor, g: _Group) -> torch.Tensor:
        """Copy the group's blocks into a reused buffer; return ``[seqs, kv_heads, keys, d]``."""
        num_blocks = cache.shape[0]
        width = cache[0].numel()
        n_rows = g.block_index.numel()
        need = n_rows * width
        buf = self._workspace[which]
        if (
            buf is None
            or buf.numel() < need
            or buf.dtype != cache.dtype
            or (buf.device != cache.device)
        ):
            buf = torch.empty(need, dtype=cache.dtype, device=cache.device)
            self._workspace[which] = buf
        out = buf[:need].view(n_rows, width)
        torch.index_select(cache.view(num_blocks, width), 0, g.block_index, out=out)
        bs = cache.shape[1]
        paged = out.view(g.num_seqs, g.blocks_per_seq * bs, cache.shape[2], cache.shape[3])
        return paged[:, : g.key_len].transpose(1, 2)
