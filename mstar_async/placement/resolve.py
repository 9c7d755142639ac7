"""A placement checked against a model: every node of every walk resolved to its ranks.

An engine may hold per-request state (the ``Engine`` contract's ``release`` drops it: KV
blocks, generators). Nothing here can tell which engines do without building them, so every
engine is treated as possibly stateful: a migration is reported whenever a request's steps of
one engine change ranks between walks, and the runtime moves whatever the engine holds (for a
stateless engine, nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeAlias

from mstar_async.errors import PlacementError
from mstar_async.graph.blocks import Block, DynamicLoop, Loop, children, node_names

if TYPE_CHECKING:
    from mstar_async.graph import Model
    from mstar_async.placement.spec import Placement

#: How two ranks exchange tensors: in memory (same worker), ZeroMQ over IPC (same host), or
#: ZeroMQ over TCP (different hosts).
Link: TypeAlias = Literal["memory", "ipc", "tcp"]


@dataclass(frozen=True)
class Migration:
    """A request's state in ``engine`` must move when the request goes from walk ``from_walk``
    to walk ``to_walk``: its steps of that engine ran on ``src_ranks`` and now run on
    ``dst_ranks``. The two are disjoint; with replicas on either side, the state moves from the
    replica the request used to the one the router picks among ``dst_ranks``."""

    engine: str
    from_walk: str
    to_walk: str
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ResolvedPlacement:
    """A placement that fits its model, with every lookup the runtime needs worked out.

    ``walks`` maps every walk to every one of its nodes and their ranks; ``engine_ranks`` maps
    every walk to the ranks of each engine it uses; ``engines`` maps every rank to the engines
    it builds (each once, however many nodes use it); ``devices`` and ``hosts`` cover every rank
    (``"cpu"`` and ``None`` when not given); ``migrations`` lists the state moves for walks run
    in the model's declaration order (``walk_order``). Build it with ``Placement.validate``.
    """

    placement: Placement
    model: str
    walks: Mapping[str, Mapping[str, tuple[int, ...]]]
    engine_ranks: Mapping[str, Mapping[str, tuple[int, ...]]]
    engines: Mapping[int, frozenset[str]]
    devices: Mapping[int, str]
    hosts: Mapping[int, str | None]
    walk_order: tuple[str, ...]
    migrations: tuple[Migration, ...]

    @property
    def ranks(self) -> int:
        """The number of worker ranks."""
        return self.placement.ranks

    def ranks_for(self, walk: str, node: str) -> tuple[int, ...]:
        """The rank(s) that run ``node`` in ``walk``.

        Raises:
            PlacementError: the walk is unknown or the node is not in it.
        """
        nodes = self._walk(walk)
        if node not in nodes:
            raise PlacementError(f"walk {walk!r} has no node {node!r}; its nodes: {sorted(nodes)}")
        return nodes[node]

    def engines_on(self, rank: int) -> frozenset[str]:
        """The engines ``rank`` builds.

        Raises:
            PlacementError: ``rank`` is out of range.
        """
        if rank not in self.engines:
            raise PlacementError(f"rank {rank} is out of range: ranks are 0..{self.ranks - 1}")
        return self.engines[rank]

    def handoff(self, engine: str, from_walk: str, to_walk: str) -> Migration | None:
        """The migration of ``engine``'s state when a request runs ``to_walk`` right after it
        last used ``engine`` in ``from_walk``; ``None`` if the ranks are the same or a walk does
        not use the engine.

        Raises:
            PlacementError: a walk is unknown.
        """
        self._walk(from_walk)
        self._walk(to_walk)
        return _handoff(self.engine_ranks, engine, from_walk, to_walk)

    def migrations_for(self, walk_order: Sequence[str] | None = None) -> list[Migration]:
        """The state moves when one request runs ``walk_order`` (default: the model's walks in
        declaration order; a walk may repeat). Each engine's state moves from the last walk that
        used it to the next walk that uses it on other ranks.

        Raises:
            PlacementError: ``walk_order`` names an unknown walk.
        """
        order = self.walk_order if walk_order is None else tuple(walk_order)
        for walk in order:
            self._walk(walk)
        return _moves(self.engine_ranks, order)

    def link(self, a: int, b: int) -> Link:
        """How ranks ``a`` and ``b`` exchange tensors (``validate`` has checked that every pair
        a walk or a migration uses can talk).

        Raises:
            PlacementError: a rank is out of range, or the two cannot talk (see ``can_talk``).
        """
        for rank in (a, b):
            if rank not in self.hosts:
                raise PlacementError(f"rank {rank} is out of range: ranks are 0..{self.ranks - 1}")
        if a == b:
            return "memory"
        if self.hosts[a] == self.hosts[b]:
            return "ipc"
        if not can_talk(self.hosts, a, b):
            raise PlacementError(
                f"ranks {a} and {b} cannot talk: {_where(self.hosts, a)} and "
                f"{_where(self.hosts, b)}; give rank {a if self.hosts[a] is None else b} a host "
                "address in hosts:"
            )
        return "tcp"

    def _walk(self, walk: str) -> Mapping[str, tuple[int, ...]]:
        if walk not in self.walks:
            raise PlacementError(
                f"model {self.model!r} has no walk {walk!r}; its walks: {list(self.walks)}"
            )
        return self.walks[walk]


def _handoff(
    engine_ranks: Mapping[str, Mapping[str, tuple[int, ...]]],
    engine: str,
    from_walk: str,
    to_walk: str,
) -> Migration | None:
    src = engine_ranks[from_walk].get(engine)
    dst = engine_ranks[to_walk].get(engine)
    if src is None or dst is None or src == dst:
        return None
    return Migration(engine, from_walk, to_walk, src, dst)


def _moves(
    engine_ranks: Mapping[str, Mapping[str, tuple[int, ...]]], order: Sequence[str]
) -> list[Migration]:
    last: dict[str, str] = {}  # engine -> the last walk in order that used it
    moves: list[Migration] = []
    for walk in order:
        for engine in engine_ranks[walk]:
            if engine in last:
                move = _handoff(engine_ranks, engine, last[engine], walk)
                if move is not None:
                    moves.append(move)
            last[engine] = walk
    return moves


def can_talk(hosts: Mapping[int, str | None], a: int, b: int) -> bool:
    """Whether ranks ``a`` and ``b`` can exchange tensors: they are one rank, or on one host
    (the same address, or both without one: IPC), or both have a host address (TCP). A rank
    without an address is reachable only over IPC, so it cannot talk to a remote rank."""
    ha, hb = hosts.get(a), hosts.get(b)
    return a == b or ha == hb or (ha is not None and hb is not None)


def _where(hosts: Mapping[int, str | None], rank: int) -> str:
    host = hosts.get(rank)
    return f"rank {rank} (no host: local, IPC only)" if host is None else f"rank {rank} ({host})"


def _check_names(placement: Placement, model: Model) -> None:
    if placement.model is not None and placement.model != model.name:
        raise PlacementError(
            f"placement is written for model {placement.model!r}, not {model.name!r}; "
            "use a placement for this model, or change its model: line"
        )
    for node in placement.nodes:
        if node not in model.nodes:
            raise PlacementError(
                f"placement: nodes names unknown node {node!r}; "
                f"model {model.name!r} has nodes {sorted(model.nodes)}"
            )
    for walk, overrides in placement.walks.items():
        if walk not in model.walks:
            raise PlacementError(
                f"placement: walks names unknown walk {walk!r}; "
                f"model {model.name!r} has walks {list(model.walks)}"
            )
        in_walk = model.plans[walk].nodes
        for node in overrides:
            if node not in in_walk:
                raise PlacementError(
                    f"placement: walks.{walk} names node {node!r}, which walk {walk!r} does not "
                    f"run; its nodes: {list(in_walk)}"
                )


def _engine_ranks(
    model: Model, walks: Mapping[str, Mapping[str, tuple[int, ...]]]
) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each walk's ranks per engine; nodes of one engine in one walk must agree, because a
    request's state cannot follow it between ranks in the middle of a walk."""
    result: dict[str, dict[str, tuple[int, ...]]] = {}
    for walk, nodes in walks.items():
        per_engine: dict[str, tuple[int, ...]] = {}
        first: dict[str, str] = {}
        for node, ranks in nodes.items():
            engine = model.nodes[node].engine
            if engine not in per_engine:
                per_engine[engine], first[engine] = ranks, node
            elif per_engine[engine] != ranks:
                raise PlacementError(
                    f"walk {walk!r}: nodes {first[engine]!r} (ranks {list(per_engine[engine])}) "
                    f"and {node!r} (ranks {list(ranks)}) share engine {engine!r} but are placed "
                    "apart; a request's state in an engine cannot move in the middle of a walk. "
                    "Put them on the same rank(s)"
                )
        result[walk] = per_engine
    return result


def _check_loops(model: Model, walks: Mapping[str, Mapping[str, tuple[int, ...]]]) -> None:
    """Every loop of every walk, with everything inside it, sits on one rank (or one replica
    set): its iterations run on one worker, so nothing crosses a process per step."""
    for walk, nodes in walks.items():
        for loop in _loops(model.plans[walk].walk.body):
            names = node_names(loop)
            if len({nodes[name] for name in names}) > 1:
                where = ", ".join(f"{name!r} on {_ranks_text(nodes[name])}" for name in names)
                raise PlacementError(
                    f"walk {walk!r}: its {type(loop).__name__} over nodes {names} spans ranks "
                    f"({where}); a loop lives on one rank, so that its steps never cross a "
                    "process: place every node of the loop on the same rank (or the same "
                    "replicas), e.g. with a walks: override for this walk"
                )


def _loops(block: Block) -> list[Block]:
    """The outermost loops in ``block`` (a loop's inner loops are inside its ranks)."""
    if isinstance(block, Loop | DynamicLoop):
        return [block]
    return [loop for child in children(block) for loop in _loops(child)]


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _check_across_walks(engine_ranks: Mapping[str, Mapping[str, tuple[int, ...]]]) -> None:
    """Between walks an engine's ranks must be the same (state stays) or disjoint (state
    moves); a partial overlap would make the move depend on which replica a request got."""
    seen: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for walk, engines in engine_ranks.items():
        for engine, ranks in engines.items():
            for other_walk, other in seen.get(engine, []):
                overlap = set(ranks) & set(other)
                if ranks != other and overlap:
                    raise PlacementError(
                        f"engine {engine!r} runs on ranks {list(other)} in walk {other_walk!r} "
                        f"but on ranks {list(ranks)} in walk {walk!r}: they overlap on "
                        f"{sorted(overlap)} without being equal, so whether a request's state "
                        "moves would depend on its replica. Give the engine the same ranks in "
                        "both walks, or ranks that do not overlap"
                    )
            seen.setdefault(engine, []).append((walk, ranks))


def _check_links(
    model: Model,
    walks: Mapping[str, Mapping[str, tuple[int, ...]]],
    hosts: Mapping[int, str | None],
    moves: Sequence[Migration],
) -> None:
    """Every in-walk edge and every migration must join ranks that can talk. Values kept
    between walks go through the request's state in the conductor, which reaches every rank."""
    for walk, nodes in walks.items():
        for edge in model.plans[walk].edges:
            for a in nodes[edge.src.node]:
                for b in nodes[edge.dst.node]:
                    if not can_talk(hosts, a, b):
                        raise PlacementError(
                            f"walk {walk!r} cannot connect its nodes: edge {edge.edge} joins "
                            f"{_where(hosts, a)} and {_where(hosts, b)}. A rank on another host "
                            f"is reachable only over TCP: give rank "
                            f"{a if hosts.get(a) is None else b} a host address in hosts:, or "
                            "put both nodes on one host"
                        )
    for move in moves:
        for a in move.src_ranks:
            for b in move.dst_ranks:
                if not can_talk(hosts, a, b):
                    raise PlacementError(
                        f"engine {move.engine!r}: a request's state moves from walk "
                        f"{move.from_walk!r} on {_where(hosts, a)} to walk {move.to_walk!r} on "
                        f"{_where(hosts, b)}, which cannot talk; give rank "
                        f"{a if hosts.get(a) is None else b} a host address in hosts:"
                    )


def resolve(placement: Placement, model: Model) -> ResolvedPlacement:
    """Check ``placement`` against ``model`` and resolve it.

    Raises:
        PlacementError: the placement names another model; ``nodes`` names an unknown node;
            ``walks`` names an unknown walk, or a node that walk does not run; two nodes of
            one engine in one walk are on different ranks; a loop's nodes are on different
            ranks; an engine's ranks in two walks overlap without being equal; a rank runs
            no node; an edge of a walk, or a migration, joins a rank without a host address
            to a rank on another host.
    """
    _check_names(placement, model)
    walks = {
        walk: {node: placement.ranks_for(walk, node) for node in plan.nodes}
        for walk, plan in model.plans.items()
    }
    engine_ranks = _engine_ranks(model, walks)
    _check_loops(model, walks)
    _check_across_walks(engine_ranks)

    engines: dict[int, set[str]] = {rank: set() for rank in range(placement.ranks)}
    for per_engine in engine_ranks.values():
        for engine, ranks in per_engine.items():
            for rank in ranks:
                engines[rank].add(engine)
    idle = [rank for rank, built in engines.items() if not built]
    if idle:
        raise PlacementError(
            f"rank(s) {idle} run no node of model {model.name!r}, so their workers would sit "
            f"idle; place a node there or lower ranks: (now {placement.ranks})"
        )

    hosts = {rank: placement.hosts.get(rank) for rank in range(placement.ranks)}
    # Links are checked for every ordered pair of walks, not just declaration order: the
    # request program decides the order at run time.
    every_move = [
        move
        for a in walks
        for b in walks
        if a != b
        for engine in engine_ranks[a]
        if (move := _handoff(engine_ranks, engine, a, b)) is not None
    ]
    _check_links(model, walks, hosts, every_move)
    order = tuple(model.walks)
    return ResolvedPlacement(
        placement=placement,
        model=model.name,
        walks=MappingProxyType({w: MappingProxyType(n) for w, n in walks.items()}),
        engine_ranks=MappingProxyType({w: MappingProxyType(e) for w, e in engine_ranks.items()}),
        engines=MappingProxyType({rank: frozenset(e) for rank, e in engines.items()}),
        devices=MappingProxyType(
            {rank: placement.devices.get(rank, "cpu") for rank in range(placement.ranks)}
        ),
        hosts=MappingProxyType(hosts),
        walk_order=order,
        migrations=tuple(_moves(engine_ranks, order)),
    )
