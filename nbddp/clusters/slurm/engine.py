"""Ranks on a Slurm allocation: the Slurm :class:`~nbddp.clusters.engine.Engine` of a launch.

* Reservation: none to make. The allocation holds the nodes; a launch takes its first
  ``nodes`` nodes (in Slurm's order: node rank 0 is the first) and their warm helpers.
* Calls are framed messages to each node's helper (``link.py``), answered as futures; the
  call's bytes travel beside the message, once per node; a helper that does not answer is
  ended by closing its connection, and the next launch starts the helpers again.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from nbddp.clusters.slurm.link import HelperLink, OutOfBand

if TYPE_CHECKING:
    from nbddp.clusters.slurm.allocation import SlurmCluster
    from nbddp.plan import LaunchPlan


class SlurmEngine:
    """One launch on a Slurm allocation."""

    ship_hint = (
        "The helpers on Slurm's nodes run this kernel's Python (sys.executable) in its "
        "working directory with its environment (PYTHONPATH included): install the module "
        "there, or keep it on a filesystem every node shares."
    )

    def __init__(self, cluster: SlurmCluster) -> None:
        self._cluster = cluster

    def reserve(self, plan: LaunchPlan) -> list[Any]:
        return list(self._cluster.helpers(plan.nodes))

    def info(self, node: HelperLink) -> dict[str, Any]:
        assert node.info is not None
        return node.info

    def call(self, node: HelperLink, method: str, *args: Any) -> Future[Any]:
        return node.call(method, *args)

    def wait(self, pending: list[Future[Any]], timeout: float) -> list[Future[Any]]:
        done, _ = wait_futures(pending, max(0.0, timeout), return_when=FIRST_COMPLETED)
        return list(done)

    def get(self, pending: Future[Any]) -> Any:
        return pending.result()

    def share(self, buffers: list[Any]) -> Any:
        return OutOfBand(buffers)

    def forget(self, node: HelperLink) -> None:
        """Nothing to do: a gone link marks the step broken, and the next launch starts the
        helpers again (``SlurmCluster.helpers``)."""

    def kill(self, node: HelperLink) -> None:
        node.close()

    def gpus(self, node_rank: int) -> tuple[str, ...] | None:
        return None  # the helper's step holds the node's GPUs (srun --gpus-per-node)

    def release(self, intact: bool) -> None:
        """Nothing to free: the allocation stays for the next launch."""
