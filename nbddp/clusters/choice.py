"""Which cluster a launch names: ``cluster=`` resolved to a cluster object, and the default
:func:`set_cluster` keeps for later launches, ``%%ddp`` cells and sessions.

Each engine is imported only when a launch names it (Ray only for "ray...", nothing for Slurm
but its command-line tools).
"""

from __future__ import annotations

from typing import Any

from nbddp.clusters.placement import Cluster

_default: Cluster | None = None


def set_cluster(cluster: Any) -> None:
    """Launch on ``cluster`` by default from now on (``notebook_launch``, ``%%ddp``,
    ``Session``): "ray", "ray://host:port", "slurm", an [nbddp.RayCluster][] or
    [nbddp.SlurmCluster][], or None for this machine."""
    global _default
    _default = None if cluster is None else resolve(cluster)


def resolve(cluster: Any) -> Cluster | None:
    """The cluster an option names (the default from :func:`set_cluster` when None)."""
    from nbddp.clusters.ray.cluster import RayCluster, named
    from nbddp.clusters.slurm.allocation import SlurmCluster, current_allocation

    if cluster is None:
        return _default
    if isinstance(cluster, (RayCluster, SlurmCluster)):
        return cluster
    if cluster == "ray" or (isinstance(cluster, str) and cluster.startswith("ray://")):
        return named(cluster)
    if cluster == "slurm":
        return current_allocation()
    raise ValueError(
        f"cluster={cluster!r} is not one of 'ray', 'ray://host:port', 'slurm', a "
        "nbddp.RayCluster or nbddp.SlurmCluster, or None (this machine)."
    )
