"""A small paged-attention world for tests: allocator + cache + backend + a dense reference.

Every sequence's K/V history is also kept contiguously (as the cache dtype rounded it, in
float64), so a step's backend output can be compared with plain causal attention computed in
float64 over the full history.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from mstar_async.engines.kv import (
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    PagedKVAllocator,
    PagedKVCache,
)

K = TypeVar("K", bound=Hashable)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention in float64 for one sequence: q [Q, H, D] are the last Q of k, v [L, Hkv, D].

    Query i sees keys 0 .. L - Q + i.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_q, heads, _ = q.shape
    n_k = k.shape[0]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(n_q).view(-1, 1)
    j = torch.arange(n_k).view(1, -1)
    scores = scores.masked_fill(j > n_k - n_q + i, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


@dataclass
class World:
    """Drives allocator, cache and backend the way an engine step would, and checks results."""

    spec: AttentionSpec
    backend: AttentionBackend
    num_blocks: int = 37
    block_size: int = 4
    num_layers: int = 2
    device: str = "cpu"
    seed: int = 0
    scramble: bool = True
    twin: AttentionBackend | None = None  # a second backend to run on the same cache
    history: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)
        self.alloc = PagedKVAllocator(self.num_blocks, self.block_size)
        self.cache = PagedKVCache(
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            dtype=self.spec.dtype,
            device=self.device,
        )
        self.cache.kv.normal_(generator=None)  # garbage in unused blocks must never be read
        if self.scramble:
            self._scramble_free_list()

    def _scramble_free_list(self) -> None:
        """Take every block as a one-block sequence and free them in random order, so later
        block tables are not contiguous or ascending."""
        order = list(range(self.num_blocks))
        for b in order:
            self.alloc.add(("scramble", b))
            self.alloc.append(("scramble", b), 1)
        random.Random(self.seed).shuffle(order)
        for b in order:
            self.alloc.free(("scramble", b))

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.rng).to(self.spec.dtype)

    def add(self, seq: Hashable) -> None:
        self.alloc.add(seq)
        self.history[seq] = [(self._empty(), self._empty()) for _ in range(self.num_layers)]

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.spec.num_kv_heads, self.spec.head_dim, dtype=torch.float64)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        self.alloc.fork(parent, child)
        self.history[child] = list(self.history[parent])

    def free(self, seq: Hashable) -> None:
        self.alloc.free(seq)
        del self.history[seq]

    def step(self, requests: Mapping[K, int]) -> dict[str, float]:
        """Append, copy, write and attend; return the max abs error against the reference
        ("err"), the number of SDPA groups (torch backend only) and, with a twin backend, the
        max abs difference between the two ("twin_err")."""
        spec = self.spec
        plans = self.alloc.append_batch(requests)
        self.cache.copy_blocks([c for p in plans for c in p.copies])
        layout = BatchLayout.from_plans(self.alloc, plans)
        meta = self.backend.plan(layout)
        twin_meta = self.twin.plan(layout) if self.twin is not None else None
        worst = twin_worst = 0.0
        for layer in range(self.num_layers):
            n = layout.num_query_tokens
            q = self._randn(n, spec.num_heads, spec.head_dim)
            k = self._randn(n, spec.num_kv_heads, spec.head_dim)
            v = self._randn(n, spec.num_kv_heads, spec.head_dim)
            dev = torch.device(self.device)
            self.cache.write(layer, meta.slot_mapping, k.to(dev), v.to(dev))
            out = self.backend.forward(
                q.to(dev), self.cache.key(layer), self.cache.value(layer), meta
            )
            assert out.shape == q.shape and out.dtype == spec.dtype
            if self.twin is not None and twin_meta is not None:
                other = self.twin.forward(
                    q.to(dev), self.cache.key(layer), self.cache.value(layer), twin_meta
                )
                twin_worst = max(twin_worst, (out.double() - other.double()).abs().max().item())
            out = out.cpu().double()
            start = 0
            for seq, q_len in zip(layout.seq_ids, layout.query_lens, strict=True):
                hk, hv = self.history[seq][layer]
                hk = torch.cat([hk, k[start : start + q_len].double()])
                hv = torch.cat([hv, v[start : start + q_len].double()])
                self.history[seq][layer] = (hk, hv)
                ref = dense_reference(q[start : start + q_len], hk, hv, spec.softmax_scale)
                err = (out[start : start + q_len] - ref).abs().max().item()
                worst = max(worst, err)
                start += q_len
        groups = getattr(meta, "groups", ())
        return {"err": worst, "groups": float(len(groups)), "twin_err": twin_worst}
