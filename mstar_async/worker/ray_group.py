"""One Ray placement group for a pool's ranks: a bundle per rank, reserved together.

``RayLauncher`` reserves every rank's resources at once, with the placement's strategy (PACK:
as few nodes as fit, SPREAD: as many), and schedules each rank's actor into its own bundle.
When a node dies, Ray reschedules that node's bundles onto a live node that fits them (one
that joins later included), so a rank restarted into its bundle lands where Ray put it.

Ray is handed in (``ray``: the imported module), never imported here; everything it returns
is typed Any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from mstar_async.errors import WorkerLost
from mstar_async.logs import get_logger

__all__ = ["RankGroup", "bundle_of"]

log = get_logger("mstar_async.worker.ray_group")


def bundle_of(request: Mapping[str, float]) -> dict[str, float]:
    """A rank's resource request as a Ray bundle: zero amounts left out (Ray refuses a bundle
    entry of 0). Never raises."""
    return {name: float(amount) for name, amount in request.items() if amount > 0}


class RankGroup:
    """A Ray placement group whose bundle ``i`` is rank ``i``'s resources.

    Use ``await RankGroup.reserve(...)`` to make one, ``strategy_for(rank)`` as an actor's
    ``scheduling_strategy``, and ``remove()`` to give the resources back.
    """

    def __init__(self, ray: Any, group: Any, bundles: Sequence[Mapping[str, float]]) -> None:
        self._ray = ray
        self.group = group
        self.bundles = [dict(b) for b in bundles]

    @classmethod
    async def reserve(
        cls,
        ray: Any,
        bundles: Sequence[Mapping[str, float]],
        strategy: str,
        name: str,
        wait_s: float,
    ) -> RankGroup:
        """Create the group and wait until Ray has reserved every bundle.

        Cancel-safe: a cancelled or failed reservation removes the group.

        Raises:
            WorkerLost: the bundles were not all reserved within ``wait_s`` seconds (the
                message names them and the strategy).
        """
        group = ray.util.placement_group(list(bundles), strategy=strategy, name=name)
        made = cls(ray, group, bundles)
        ready = asyncio.wrap_future(group.ready().future())
        ready.add_done_callback(_consume)
        try:
            with anyio.fail_after(wait_s):
                await asyncio.wait([ready])
            ready.result()
        except TimeoutError:
            made.remove()
            raise WorkerLost(
                f"Ray did not reserve the ranks' resources within {wait_s} s: bundles "
                f"{made.bundles} with strategy {strategy} (does the cluster have them free? "
                "STRICT_SPREAD and SPREAD need nodes enough)"
            ) from None
        except BaseException:
            made.remove()
            raise
        log.info("worker.ray_group", name=name, bundles=made.bundles, strategy=strategy)
        return made

    def strategy_for(self, rank: int) -> Any:
        """The scheduling strategy that puts an actor into ``rank``'s bundle.

        Raises:
            WorkerLost: the group has no bundle for ``rank``.
        """
        if not 0 <= rank < len(self.bundles):
            raise WorkerLost(f"the Ray placement group has no bundle for rank {rank}")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=rank
        )

    def remove(self) -> None:
        """Give the reserved resources back. Idempotent; never raises."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            self._ray.util.remove_placement_group(group)
        except Exception as exc:
            # Best effort: Ray removes a driver's placement groups when the driver exits.
            log.warning("worker.ray_group_remove_failed", error=repr(exc))


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
