"""Which cluster a launch names: ``cluster=`` resolved to a cluster object, and the default
:func:`set_cluster` keeps for later launches, ``%%ddp`` cells and sessions; whether a run can
be detached there, and where its ranks go.

Each engine is imported only when a launch names it (Ray only for "ray...", nothing for Slurm
but its command-line tools).
"""

from __future__ import annotations

from typing import Any, Literal

from nbddp.clusters.placement import Cluster, place_on_cluster

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


def check_detachable(detach: Any, cluster: Any, debug: Any = False) -> None:
    """``detach=``: where a run cannot be detached, say so before anything starts."""
    if not isinstance(detach, bool):
        raise ValueError(f"detach={detach!r} must be True or False.")
    if detach and debug is True:
        raise ValueError(
            "debug=True opens pdb in the notebook's input box, but a detached run has none "
            "(kernels come and go): drop detach=True to debug the run, or drop debug=True."
        )
    if not detach or cluster is None:
        return
    if type(cluster).__name__ not in ("RayCluster", "SlurmCluster"):
        raise ValueError(f"detach=True cannot run on {cluster!r}.")


def place_launch(
    cluster: Cluster,
    num_workers: int | str,
    device: str,
    nodes: int | str,
    workers_per_node: int | str,
    detach: bool,
) -> tuple[Literal["cuda", "cpu"], int, int, list[str]]:
    """Device, nodes, ranks per node, and a detached run's batch job's sbatch options on
    Slurm (none elsewhere: the ranks are placed on the cluster's nodes as they are now)."""
    from nbddp.clusters.slurm.allocation import SlurmCluster

    if detach and isinstance(cluster, SlurmCluster):  # a batch job: no allocation to place on
        from nbddp.clusters.slurm.batch_shape import batch_shape

        return batch_shape(cluster, num_workers, device, nodes, workers_per_node)
    placed = place_on_cluster(cluster, num_workers, device, nodes, workers_per_node)
    return (*placed, [])
