"""How a walk whose nodes span ranks splits into per-rank segments, worked out from its plan.

A walk splits when every loop in it, with everything inside, sits on one rank. Then each rank
runs its own loops, carries and ``until``; every edge between ranks has its scope at the walk's
top level (outside all loops), so its value crosses once (a plain edge) or per item (a streaming
edge), never per step. A walk with a loop spanning ranks does not split (``split_walk`` returns
``None``); placement refuses such a layout (``Placement.validate``).

Every rank interprets the whole walk, owning only its blocks. The walk's *units* are the largest
blocks that sit on one rank (a node, a loop, or a container whose nodes are all on one rank); the
containers above them are mixed and every rank runs them. A rank reaching another rank's unit
does not run it but waits until the owner reports it done, so ``Sequential`` and ``Parallel``
order the units across ranks exactly as in one process. Units are numbered in walk order: the
number names a unit on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mstar_async.graph.blocks import Block, DynamicLoop, Loop, NodeRef, children, node_names
from mstar_async.graph.plan import EdgePlan, WalkPlan


@dataclass(frozen=True, eq=False)
class CrossEdge:
    """An edge whose producer and consumer sit on different ranks."""

    edge: EdgePlan
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, eq=False)
class Segment:
    """One rank's part of a split walk.

    ``waits``: units of other ranks this rank's interpreter reaches, by unit number; ``reports``:
    its own units, whose end the other ranks wait for; ``sends``: edges from here to another
    rank, with the key that names them on the wire (the consumer's ``"node.port"``);
    ``receives``: edges from another rank to here, by that key.
    """

    rank: int
    waits: Mapping[Block, int]
    reports: Mapping[Block, int]
    sends: Mapping[EdgePlan, str]
    receives: Mapping[str, EdgePlan]


@dataclass(frozen=True, eq=False)
class WalkSplit:
    """A walk split across ``ranks`` (sorted): each node's rank, the edges between ranks by key,
    and each rank's ``Segment``."""

    plan: WalkPlan
    node_ranks: Mapping[str, int]
    ranks: tuple[int, ...]
    cross: Mapping[str, CrossEdge]
    segments: Mapping[int, Segment]


def split_walk(plan: WalkPlan, node_ranks: Mapping[str, int]) -> WalkSplit | None:
    """Split ``plan`` by ``node_ranks`` (every node of the walk -> its rank), or ``None`` when a
    loop spans ranks (the walk then cannot run as segments).

    Raises:
        KeyError: ``node_ranks`` misses a node of the walk.
    """
    block_rank: dict[Block, int | None] = {}
    if not _rank_blocks(plan.walk.body, node_ranks, block_rank):
        return None
    units: list[tuple[Block, int]] = []
    _units(plan.walk.body, block_rank, units)
    cross = {
        str(edge.dst): CrossEdge(edge, node_ranks[edge.src.node], node_ranks[edge.dst.node])
        for edge in plan.edges
        if node_ranks[edge.src.node] != node_ranks[edge.dst.node]
    }
    ranks = tuple(sorted(set(node_ranks[name] for name in plan.nodes)))
    segments = {rank: _segment(rank, units, cross) for rank in ranks}
    return WalkSplit(plan, dict(node_ranks), ranks, cross, segments)


def _rank_blocks(block: Block, node_ranks: Mapping[str, int], out: dict[Block, int | None]) -> bool:
    """Fill ``out`` with each block's rank (``None``: mixed); False when a loop is mixed."""
    if isinstance(block, NodeRef):
        out[block] = node_ranks[block.name]
        return True
    if not all(_rank_blocks(child, node_ranks, out) for child in children(block)):
        return False
    ranks = {node_ranks[name] for name in node_names(block)}
    out[block] = ranks.pop() if len(ranks) == 1 else None
    return out[block] is not None or not isinstance(block, Loop | DynamicLoop)


def _units(
    block: Block, block_rank: Mapping[Block, int | None], out: list[tuple[Block, int]]
) -> None:
    rank = block_rank[block]
    if rank is not None:
        out.append((block, rank))
        return
    for child in children(block):
        _units(child, block_rank, out)


def _segment(rank: int, units: list[tuple[Block, int]], cross: Mapping[str, CrossEdge]) -> Segment:
    return Segment(
        rank=rank,
        waits={block: i for i, (block, owner) in enumerate(units) if owner != rank},
        reports={block: i for i, (block, owner) in enumerate(units) if owner == rank},
        sends={c.edge: key for key, c in cross.items() if c.src_rank == rank},
        receives={key: c.edge for key, c in cross.items() if c.dst_rank == rank},
    )
