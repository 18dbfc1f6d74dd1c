"""Ranks on a Ray cluster: the Ray :class:`~nbddp.clusters.engine.Engine` of a launch.

* Reservation: one placement group reserves ``workers_per_node`` ranks' worth of resources
  (GPUs on cuda, CPUs on cpu) on each of ``nodes`` nodes (``STRICT_SPREAD``, one bundle per
  node); bundle i's node is node rank i. On cuda an actor in each bundle holds its GPUs and
  says which Ray gave it: those are the ranks' (``cluster.lease_gpus``). The reservation is
  kept a few seconds after the launch for the next launch of the same shape
  (``RayCluster.keep_reservation``: Ray readies a new one made right after a removal only
  0.5-1 s later), removed at once when a node was lost.
* Calls are actor method calls on each node's helper (``node.py``); the call's bytes go to
  Ray's object store once; the poll loop waits with ``ray.wait``; a helper that does not
  answer is ended with ``ray.kill``.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from nbddp.clusters import NodeGone
from nbddp.errors import NbddpError

if TYPE_CHECKING:
    from nbddp.clusters.ray.cluster import RayCluster
    from nbddp.plan import LaunchPlan

RESERVE_WAIT = 60.0  # seconds for the cluster to reserve the ranks' resources


class RayEngine:
    """One launch on a Ray cluster: its placement group and its nodes' helper actors."""

    ship_hint = (
        "Ship them with cluster=nbddp.RayCluster(runtime_env={'py_modules': [...]}) (modules "
        "imported from the notebook's folder: runtime_env={'working_dir': '.'}), or install "
        "them on every node."
    )

    def __init__(self, cluster: RayCluster) -> None:
        self._cluster = cluster
        self._ray = cluster.connect()
        self._placement: Any = None
        self._shape: Any = None
        self._gpus: list[tuple[str, ...]] = []

    def reserve(self, plan: LaunchPlan) -> list[Any]:
        from ray.util import placement_group, placement_group_table

        unit = "GPU" if plan.device == "cuda" else "CPU"
        self._shape = (plan.nodes, plan.workers_per_node, unit)
        self._placement = self._cluster.take_reservation(self._shape) or placement_group(
            [{unit: plan.workers_per_node}] * plan.nodes, strategy="STRICT_SPREAD"
        )
        deadline = time.monotonic() + RESERVE_WAIT
        ready = False  # asked of the GCS in short waits (interruptible), not by a Ray task
        while not ready and time.monotonic() < deadline:
            ready = self._placement.wait(0.5)
        if not ready:
            raise NbddpError(
                f"the cluster could not reserve {plan.workers_per_node} {unit}(s) on each of "
                f"{plan.nodes} nodes within {RESERVE_WAIT:g} s: other work holds them. Free "
                "them, or ask for fewer nodes or ranks per node."
            )
        bundles = placement_group_table(self._placement)["bundles_to_node_id"]
        if unit == "GPU":
            from nbddp.clusters.ray.cluster import lease_gpus

            self._gpus = lease_gpus(self._placement, plan.nodes, plan.workers_per_node)
        return [bundles[index] for index in range(plan.nodes)]

    def gpus(self, node_rank: int) -> tuple[str, ...] | None:
        """The GPUs Ray reserved for node rank ``node_rank``'s ranks (cuda)."""
        return self._gpus[node_rank] if node_rank < len(self._gpus) else None

    def info(self, node: Any) -> dict[str, Any]:
        return self._cluster.info(node)

    def call(self, node: Any, method: str, *args: Any) -> Any:
        return getattr(self._cluster.helper(node), method).remote(*args)

    def wait(self, pending: list[Any], timeout: float) -> list[Any]:
        ready, _ = self._ray.wait(pending, num_returns=1, timeout=max(0.0, timeout))
        return list(ready)

    def get(self, pending: Any) -> Any:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self._ray.get(pending)
        except RayTaskError:
            raise  # the helper's method raised: the error itself
        except RayError as exc:  # the helper is gone
            first = (str(exc).splitlines() or [""])[0]
            raise NodeGone(f"{type(exc).__name__}: {first}") from exc

    def share(self, buffers: list[Any]) -> Any:
        import numpy as np

        return self._ray.put([np.frombuffer(b, dtype=np.uint8) for b in buffers])

    def forget(self, node: Any) -> None:
        self._cluster.forget(node)

    def kill(self, node: Any) -> None:
        self._ray.kill(self._cluster.helper(node))

    def release(self, intact: bool) -> None:
        from ray.exceptions import GetTimeoutError, RayError
        from ray.util import remove_placement_group

        if self._placement is None:
            return
        if intact:  # the next launch of this shape starts on it at once
            self._cluster.keep_reservation(self._shape, self._placement)
        else:
            with contextlib.suppress(RayError, GetTimeoutError):
                remove_placement_group(self._placement)
        self._placement = None
