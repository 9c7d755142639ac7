"""Nodes and edges: the vertices and arcs of a model's component graph G."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mstar_async.errors import GraphError
from mstar_async.policies import ChunkPolicy, FixedChunkPolicy

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid node, port or walk name.

    Raises:
        GraphError: the name is not a string of letters, digits, ``_`` or ``-`` (no dots: a dot
            separates a node from its port in ``"node.port"``).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise GraphError(
            f"{kind} name {name!r} is invalid: use letters, digits, '_' or '-', "
            "starting with a letter or '_' (dots separate node and port, as in 'node.port')"
        )
    return name


class PortRef(NamedTuple):
    """A port of a node, written ``"node.port"``."""

    node: str
    port: str

    @classmethod
    def parse(cls, text: str, *, role: str) -> PortRef:
        """Parse ``"node.port"``.

        Raises:
            GraphError: ``text`` is not ``node.port``; ``role`` names where it came from.
        """
        if not isinstance(text, str) or text.count(".") != 1:
            raise GraphError(f"{role} {text!r} must look like 'node.port'")
        node, port = text.split(".")
        if not node or not port:
            raise GraphError(f"{role} {text!r} must look like 'node.port'")
        return cls(node, port)

    def __str__(self) -> str:
        return f"{self.node}.{self.port}"


@dataclass(frozen=True, init=False)
class Node:
    """A component of the graph: one step of one engine, with named input and output ports.

    ``engine`` names a component of the model (built on whichever worker placement picks);
    ``op`` selects what the engine runs for this node (defaults to the node's name), so several
    nodes can share one engine (a conditional and an unconditional CFG branch share a denoiser,
    and their steps batch together).

    Raises:
        GraphError: a name is invalid or a port name repeats.
    """

    name: str
    engine: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    op: str

    def __init__(
        self,
        name: str,
        engine: str,
        *,
        inputs: Sequence[str] = (),
        outputs: Sequence[str] = (),
        op: str = "",
    ) -> None:
        object.__setattr__(self, "name", check_name("node", name))
        object.__setattr__(self, "engine", check_name(f"node {name!r}: engine", engine))
        object.__setattr__(self, "inputs", tuple(inputs))
        object.__setattr__(self, "outputs", tuple(outputs))
        object.__setattr__(self, "op", op or name)
        for kind, ports in (("input", self.inputs), ("output", self.outputs)):
            for port in ports:
                check_name(f"node {name!r}: {kind} port", port)
            if len(set(ports)) != len(ports):
                raise GraphError(f"node {name!r} names an {kind} port twice: {ports}")


@dataclass(frozen=True)
class Edge:
    """A connection from an output port to an input port, written ``Edge("a.out", "b.in")``.

    A plain edge carries one value: the producer's last output. A *streaming* edge carries every
    output the producer makes (one item per firing, e.g. per loop iteration) through a
    ``ChunkPolicy`` into a bounded buffer; its consumer fires once per chunk. ``policy`` is a
    template: each request gets ``policy.fresh()``.

    Raises:
        GraphError: a port is not ``node.port``, a policy is given on a non-streaming edge, or
            ``max_buffer`` is below 1.
    """

    src: str
    dst: str
    streaming: bool = False
    policy: ChunkPolicy | None = None
    max_buffer: int = 8
    src_ref: PortRef = field(init=False, repr=False, compare=False)
    dst_ref: PortRef = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "src_ref", PortRef.parse(self.src, role="edge source"))
        object.__setattr__(self, "dst_ref", PortRef.parse(self.dst, role="edge destination"))
        if self.policy is not None and not self.streaming:
            raise GraphError(
                f"edge {self} has a chunk policy but is not streaming: pass streaming=True "
                "(or use stream(...)), or drop the policy"
            )
        if self.streaming and self.policy is None:
            object.__setattr__(self, "policy", FixedChunkPolicy(1))
        if not isinstance(self.max_buffer, int) or self.max_buffer < 1:
            raise GraphError(
                f"edge {self}: max_buffer must be an int >= 1, got {self.max_buffer!r}"
            )

    def __str__(self) -> str:
        arrow = "~>" if self.streaming else "->"
        return f"{self.src} {arrow} {self.dst}"


def stream(src: str, dst: str, policy: ChunkPolicy | None = None, *, max_buffer: int = 8) -> Edge:
    """A streaming edge from ``src`` to ``dst`` chunked by ``policy`` (default: one item a chunk).

    Raises:
        GraphError: as ``Edge``.
    """
    return Edge(src, dst, streaming=True, policy=policy, max_buffer=max_buffer)
