"""Placement: which rank (worker process: a GPU, or a CPU process) runs each node of a model.

Pure and synchronous; imports only ``mstar_async.graph`` and ``mstar_async.errors`` of ours.

A placement is written in YAML (``Placement.from_yaml``) or built in Python. Every key is
optional; an empty document puts everything on rank 0 (``Placement.single()``)::

    model: causal-lm    # the model this placement is for; validate() refuses any other
    ranks: 2            # worker processes; default: one more than the highest rank named
    nodes:              # node -> rank, or a list of ranks (data-parallel replicas);
      decode: 1         #   a node not listed runs on rank 0
      codec: [1, 2]
    walks:              # per-walk overrides: walk -> node -> rank(s); lets one node
      decode:           #   serve two walks on different ranks
        decode: 1
    devices:            # rank -> torch device: cpu, cuda, cuda:N, mps or xpu; default cpu
      0: cpu
      1: cuda:0
    hosts:              # rank -> host address, for TCP across hosts; a rank without one is
      1: 10.0.0.2       #   on the local host and talks over IPC only
    strategy: SPREAD    # on Ray: how the ranks spread over nodes (PACK, the default, SPREAD,
                        #   STRICT_PACK, STRICT_SPREAD: Ray's placement-group strategies)
    resources:          # on Ray: rank -> what it asks for (CPU, GPU, memory in bytes, custom
      1: {CPU: 2, GPU: 1, node_b: 1}  #   resources); a rank without CPU asks for one CPU

What it expresses: everything in one process; encoder/decoder disaggregation (``codec: 1``);
prefill/decode disaggregation (the ``lm`` engine on rank 0 in walk ``prefill`` and on rank 1 in
walk ``decode``, which ``migrations`` reports as a state move); replicas (``codec: [1, 2]``,
with ``ReplicaRouter`` picking the least loaded replica per request and keeping it there).

``Placement.validate(model)`` checks it against a model and returns a ``ResolvedPlacement``
(every node of every walk resolved, each rank's engines, devices, hosts, migrations). It raises
``PlacementError`` when:

- ``ranks`` is below 1, or a rank is negative, out of range, not an int or listed twice;
- a device is not ``cpu``/``cuda``/``mps``/``xpu`` with an optional ``:N``; a host is empty;
- ``strategy`` is not one of ``STRATEGIES``; a resource amount is negative or no number, a
  resource name is a lower-case ``cpu``/``gpu``, or a rank's resources ask for nothing;
- the document has an unknown key, or ``model:`` names another model;
- ``nodes`` names an unknown node, ``walks`` an unknown walk or a node that walk does not run;
- two nodes of one engine in one walk sit on different ranks (a request's engine state cannot
  move in the middle of a walk);
- an engine's ranks in two walks overlap without being equal (whether its state moves would
  depend on the replica a request got); equal ranks keep the state, disjoint ranks move it;
- a rank runs no node (its worker would sit idle);
- an edge of a walk, or a migration, joins a rank without a host address to a rank on another
  host (a rank without an address is reachable over local IPC only).

Every engine is treated as possibly holding per-request state, since the engine contract lets
any engine keep some (``release`` drops it); moving a stateless engine's state moves nothing.
"""

from __future__ import annotations

from mstar_async.placement.resolve import Link, Migration, ResolvedPlacement, can_talk
from mstar_async.placement.router import ReplicaRouter, Route
from mstar_async.placement.spec import KEYS, STRATEGIES, Placement, RankSpec

__all__ = [
    "KEYS",
    "STRATEGIES",
    "Link",
    "Migration",
    "Placement",
    "RankSpec",
    "ReplicaRouter",
    "ResolvedPlacement",
    "Route",
    "can_talk",
]
