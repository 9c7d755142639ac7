"""``Placement``: which rank (worker process) runs each node, optionally per walk.

This module holds the declaration and the checks that need no model (rank ranges, device and
host formats, the shape of a YAML document). Checks against a model live in ``resolve``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias

import yaml

from mstar_async.errors import PlacementError

if TYPE_CHECKING:
    from mstar_async.graph import Model
    from mstar_async.placement.resolve import Migration, ResolvedPlacement

#: Where a node runs: one rank, or several (data-parallel replicas).
RankSpec: TypeAlias = int | Sequence[int]

#: The top-level keys of a placement document, in the order ``to_dict`` writes them.
KEYS = ("model", "ranks", "nodes", "walks", "devices", "hosts", "strategy", "resources")

#: How a cluster engine (Ray) spreads a placement's ranks over its nodes: Ray's placement-group
#: strategies. PACK (the default) puts the ranks on as few nodes as fit them, SPREAD on as many;
#: the STRICT forms fail rather than do otherwise.
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: The CPUs a rank asks a cluster for when ``resources`` does not say.
DEFAULT_CPUS = 1.0

# torch.device accepts more (e.g. "meta", "hpu"), but a worker only runs on these; the index
# is checked for form only, since whether cuda:3 exists is known on the worker, not here.
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:(0|[1-9][0-9]*))?$")
_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")


def _is_int(value: object) -> bool:
    # bool is an int subclass; `codec: true` in YAML is a typo, not rank 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _name(kind: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise PlacementError(f"placement: {kind} name must be a non-empty string, got {value!r}")
    return value


def _rank_key(kind: str, value: object) -> int:
    """A rank used as a mapping key: an int, or a digit string (JSON keys are strings)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if not _is_int(value):
        raise PlacementError(f"placement: {kind} keys must be ranks (ints), got {value!r}")
    assert isinstance(value, int)
    return value


def _rank_tuple(where: str, value: object) -> tuple[int, ...]:
    """Normalize ``1`` or ``[2, 1]`` to a sorted tuple of ranks (range checked later)."""
    items: list[object]
    if _is_int(value):
        items = [value]
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
    else:
        raise PlacementError(
            f"placement: {where} must be a rank or a list of ranks (replicas), got {value!r}"
        )
    if not items:
        raise PlacementError(f"placement: {where} lists no rank; give at least one")
    ranks: list[int] = []
    for item in items:
        if not _is_int(item):
            raise PlacementError(f"placement: {where}: rank {item!r} is not an int")
        assert isinstance(item, int)
        ranks.append(item)
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise PlacementError(f"placement: {where} lists rank(s) {twice} twice; list each once")
    return tuple(sorted(ranks))


def _check_range(where: str, ranks: tuple[int, ...], count: int) -> None:
    for rank in ranks:
        if rank < 0 or rank >= count:
            raise PlacementError(
                f"placement: {where} names rank {rank}, but ranks is {count} "
                f"(valid ranks: 0..{count - 1}); raise ranks: or use a rank in range"
            )


def _amount(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PlacementError(
            f"placement: {where} is {value!r}; write a number >= 0 (memory: in bytes)"
        )
    return float(value) if isinstance(value, float) else int(value)


#: Lower-case spellings of Ray's own resource names, which are case-sensitive.
_RAY_NAMES = {"cpu": "CPU", "gpu": "GPU", "cpus": "CPU", "gpus": "GPU", "mem": "memory"}


def _rank_resources(rank: int, value: object) -> dict[str, float]:
    """One rank's ``resources:`` entry, checked: resource name -> amount."""
    if not isinstance(value, Mapping):
        raise PlacementError(
            f"placement: resources.{rank} must map resource names to amounts, e.g. "
            f"{{CPU: 1, GPU: 1}}; got {value!r}"
        )
    out: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise PlacementError(
                f"placement: resources.{rank} has the resource name {name!r}; write CPU, GPU, "
                "memory or a custom resource's name"
            )
        if name in _RAY_NAMES:
            raise PlacementError(
                f"placement: resources.{rank}.{name}: resource names are case-sensitive; "
                f"write {_RAY_NAMES[name]}"
            )
        out[name] = _amount(f"resources.{rank}.{name}", amount)
    if not any(out.get(name, DEFAULT_CPUS if name == "CPU" else 0) > 0 for name in {*out, "CPU"}):
        raise PlacementError(
            f"placement: resources.{rank} asks for nothing; a rank needs some resource "
            "(leave CPU out for one CPU)"
        )
    return out


def _strategy(value: object) -> str:
    if not isinstance(value, str) or value.upper() not in STRATEGIES:
        raise PlacementError(
            f"placement: strategy is {value!r}; write one of {', '.join(STRATEGIES)}"
        )
    return value.upper()


def _plain(ranks: tuple[int, ...]) -> int | list[int]:
    return ranks[0] if len(ranks) == 1 else list(ranks)


@dataclass(frozen=True, init=False)
class Placement:
    """Which rank runs each node of a model; a rank is one worker process (a GPU or a CPU).

    ``nodes`` maps a node to its rank, or to several ranks (data-parallel replicas); a node not
    listed runs on rank 0. ``walks`` overrides that for one walk (``walks[walk][node]``), which
    is how one node serves two walks on different ranks. ``devices`` gives each rank's torch
    device (default ``"cpu"``); ``hosts`` gives a rank's host address, for TCP across hosts
    (ranks without one are on the local host). ``model``, if set, names the model the placement
    is written for, and ``validate`` refuses any other. ``ranks`` defaults to one more than the
    highest rank named anywhere (1 if none).

    On a cluster engine (``RayLauncher``), ``resources`` says what each rank asks for, by Ray's
    resource names (``CPU``, ``GPU``, ``memory`` in bytes, custom ones such as ``node_a``; a
    rank without ``CPU`` asks for one CPU, see ``resources_for``), and ``strategy`` how the
    ranks spread over the nodes (one of ``STRATEGIES``, default ``PACK``).

    Rank lists are kept sorted; the mappings are read-only.

    Raises:
        PlacementError: ``ranks`` is below 1; a rank is not an int, is out of range or listed
            twice for one node; a node lists no rank; a device is not ``cpu``, ``cuda``, ``mps``
            or ``xpu`` (optionally ``:N``); a host is empty or holds spaces; ``strategy`` is
            not one of ``STRATEGIES``; a resource amount is negative or not a number, a
            resource name is a lower-case spelling of CPU or GPU, or a rank asks for nothing.
    """

    ranks: int
    nodes: Mapping[str, tuple[int, ...]]
    walks: Mapping[str, Mapping[str, tuple[int, ...]]]
    devices: Mapping[int, str]
    hosts: Mapping[int, str]
    model: str | None
    strategy: str
    resources: Mapping[int, Mapping[str, float]]

    def __init__(
        self,
        ranks: int | None = None,
        nodes: Mapping[str, RankSpec] | None = None,
        walks: Mapping[str, Mapping[str, RankSpec]] | None = None,
        devices: Mapping[int, str] | None = None,
        hosts: Mapping[int, str] | None = None,
        model: str | None = None,
        strategy: str = "PACK",
        resources: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        node_map = {
            _name("node", n): _rank_tuple(f"nodes.{n}", r) for n, r in (nodes or {}).items()
        }
        walk_map: dict[str, dict[str, tuple[int, ...]]] = {}
        for walk, overrides in (walks or {}).items():
            _name("walk", walk)
            if not isinstance(overrides, Mapping):
                raise PlacementError(
                    f"placement: walks.{walk} must map node names to ranks, got {overrides!r}"
                )
            walk_map[walk] = {
                _name("node", n): _rank_tuple(f"walks.{walk}.{n}", r) for n, r in overrides.items()
            }
        device_map = {_rank_key("devices", k): v for k, v in (devices or {}).items()}
        host_map = {_rank_key("hosts", k): v for k, v in (hosts or {}).items()}
        if resources is not None and not isinstance(resources, Mapping):
            raise PlacementError(
                "placement: resources must map ranks to resources, e.g. {1: {GPU: 1}}; "
                f"got {resources!r}"
            )
        resource_map = {
            (rank := _rank_key("resources", k)): _rank_resources(rank, v)
            for k, v in (resources or {}).items()
        }
        if model is not None:
            _name("model", model)

        named = [r for rs in node_map.values() for r in rs]
        named += [r for w in walk_map.values() for rs in w.values() for r in rs]
        named += [*device_map, *host_map, *resource_map]
        if ranks is None:
            ranks = max(named, default=0) + 1
        if not _is_int(ranks) or ranks < 1:
            raise PlacementError(
                f"placement: ranks must be an int >= 1 (the number of worker processes), "
                f"got {ranks!r}"
            )
        for n, rs in node_map.items():
            _check_range(f"nodes.{n}", rs, ranks)
        for walk, overrides in walk_map.items():
            for n, rs in overrides.items():
                _check_range(f"walks.{walk}.{n}", rs, ranks)
        for rank, device in device_map.items():
            _check_range("devices", (rank,), ranks)
            if not isinstance(device, str) or not _DEVICE.match(device):
                raise PlacementError(
                    f"placement: devices.{rank} is {device!r}, which is not a device a worker "
                    "can use; write cpu, cuda, cuda:N, mps or xpu"
                )
        for rank, host in host_map.items():
            _check_range("hosts", (rank,), ranks)
            if not isinstance(host, str) or not _HOST.match(host):
                raise PlacementError(
                    f"placement: hosts.{rank} is {host!r}; write a host name or IP address "
                    "(no spaces, no scheme)"
                )
        for rank in resource_map:
            _check_range("resources", (rank,), ranks)

        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "nodes", MappingProxyType(node_map))
        frozen_walks = {w: MappingProxyType(o) for w, o in walk_map.items()}
        object.__setattr__(self, "walks", MappingProxyType(frozen_walks))
        object.__setattr__(self, "devices", MappingProxyType(dict(sorted(device_map.items()))))
        object.__setattr__(self, "hosts", MappingProxyType(dict(sorted(host_map.items()))))
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "strategy", _strategy(strategy))
        frozen_resources = {r: MappingProxyType(v) for r, v in sorted(resource_map.items())}
        object.__setattr__(self, "resources", MappingProxyType(frozen_resources))

    def __hash__(self) -> int:
        # The generated hash would fail on the mapping fields; hash their sorted contents.
        return hash(
            (
                self.ranks,
                tuple(sorted(self.nodes.items())),
                tuple(sorted((w, tuple(sorted(o.items()))) for w, o in self.walks.items())),
                tuple(self.devices.items()),
                tuple(self.hosts.items()),
                self.model,
                self.strategy,
                tuple((r, tuple(sorted(v.items()))) for r, v in self.resources.items()),
            )
        )

    def resources_for(self, rank: int) -> dict[str, float]:
        """What ``rank`` asks a cluster for: its ``resources`` entry, with one CPU
        (``DEFAULT_CPUS``) unless the entry says ``CPU``; zero amounts left out. Never raises."""
        asked = {"CPU": DEFAULT_CPUS, **self.resources.get(rank, {})}
        return {name: amount for name, amount in asked.items() if amount > 0}

    @classmethod
    def single(cls) -> Placement:
        """Everything in one process: every node of every walk on rank 0."""
        return cls(ranks=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        """Build a placement from a mapping shaped like the YAML document (see the package doc).

        Raises:
            PlacementError: ``data`` is not a mapping, has a key other than those in ``KEYS``,
                a section has the wrong shape, or any rule of ``Placement`` is broken.
        """
        if not isinstance(data, Mapping):
            raise PlacementError(
                f"placement must be a mapping with keys {list(KEYS)}, got {type(data).__name__}"
            )
        unknown = sorted(str(k) for k in data if k not in KEYS)
        if unknown:
            raise PlacementError(
                f"placement has unknown key(s) {unknown}; the keys are {list(KEYS)}"
            )
        sections: dict[str, Mapping[Any, Any]] = {}
        for key in ("nodes", "walks", "devices", "hosts", "resources"):
            value = data.get(key)
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise PlacementError(f"placement: {key} must be a mapping, got {value!r}")
            sections[key] = value
        return cls(
            ranks=data.get("ranks"),
            nodes=sections["nodes"],
            walks=sections["walks"],
            devices=sections["devices"],
            hosts=sections["hosts"],
            model=data.get("model"),
            strategy=data.get("strategy") or "PACK",
            resources=sections["resources"],
        )

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> Placement:
        """Parse a placement from YAML text (a ``str``) or from a file (a path object).

        An empty document is ``Placement.single()``.

        Raises:
            PlacementError: the file cannot be read, the YAML does not parse, or the document
                breaks a rule of ``from_dict``.
        """
        if isinstance(source, os.PathLike):
            path = Path(source)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise PlacementError(f"cannot read placement file {path}: {exc}") from exc
            origin = str(path)
        else:
            text, origin = source, "placement YAML"
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlacementError(f"{origin} is not valid YAML: {exc}") from exc
        if data is None:
            return cls.single()
        if isinstance(data, str):
            raise PlacementError(
                f"{origin} is the plain string {data!r}, not a mapping; to load a file, "
                "pass a pathlib.Path rather than a str"
            )
        if not isinstance(source, os.PathLike):
            return cls.from_dict(data)
        try:
            return cls.from_dict(data)
        except PlacementError as exc:
            # Name the file: a runtime may load several placements.
            raise PlacementError(f"{origin}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The placement as plain data (``from_dict`` gives it back); empty sections left out,
        a single rank written as an int and replicas as a list."""
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self.model
        out["ranks"] = self.ranks
        if self.nodes:
            out["nodes"] = {n: _plain(r) for n, r in self.nodes.items()}
        if self.walks:
            out["walks"] = {w: {n: _plain(r) for n, r in o.items()} for w, o in self.walks.items()}
        if self.devices:
            out["devices"] = dict(self.devices)
        if self.hosts:
            out["hosts"] = dict(self.hosts)
        if self.strategy != "PACK":
            out["strategy"] = self.strategy
        if self.resources:
            out["resources"] = {r: dict(v) for r, v in self.resources.items()}
        return out

    def to_yaml(self) -> str:
        """The placement as a YAML document (``from_yaml`` gives it back)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def ranks_for(self, walk: str, node: str) -> tuple[int, ...]:
        """The rank(s) that run ``node`` in ``walk``: the walk's override, else the node's
        entry, else rank 0. Names are not checked here; ``validate`` checks them."""
        override = self.walks.get(walk, {}).get(node)
        if override is not None:
            return override
        return self.nodes.get(node, (0,))

    def validate(self, model: Model) -> ResolvedPlacement:
        """Check this placement against ``model`` and resolve every node of every walk.

        Raises:
            PlacementError: see ``mstar_async.placement.resolve.resolve`` for the rules.
        """
        from mstar_async.placement.resolve import resolve

        return resolve(self, model)

    def engines_on(self, rank: int, model: Model) -> frozenset[str]:
        """The engines (components of ``model``) that ``rank`` builds.

        Raises:
            PlacementError: the placement does not fit ``model``, or ``rank`` is out of range.
        """
        return self.validate(model).engines_on(rank)

    def migrations(self, model: Model, walk_order: Sequence[str] | None = None) -> list[Migration]:
        """Where a request's engine state must move between walks; see
        ``ResolvedPlacement.migrations_for``.

        Raises:
            PlacementError: the placement does not fit ``model``, or ``walk_order`` names an
                unknown walk.
        """
        return self.validate(model).migrations_for(walk_order)
