"""Where a launch's ranks go on a cluster, whatever the engine: how many nodes, how many ranks
on each, on which device; every "auto" resolved and every request the cluster cannot hold
refused, naming what it has, before anything starts.

Non-goal: reserving the nodes (the engine does, at the launch's start).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol


class NodeInfo(NamedTuple):
    """A node ranks can go to, as its engine describes it."""

    id: str
    address: str
    cpus: float
    gpus: float


class Cluster(Protocol):
    """What ``cluster=`` names (a :class:`~nbddp.clusters.ray.cluster.RayCluster`, a
    :class:`~nbddp.clusters.slurm.allocation.SlurmCluster`)."""

    def alive_nodes(self) -> list[NodeInfo]:
        """The nodes ranks can go to now."""


def place_on_cluster(
    cluster: Cluster,
    num_workers: int | str,
    device: str,
    nodes: int | str,
    workers_per_node: int | str,
) -> tuple[Literal["cuda", "cpu"], int, int]:
    """Device, nodes and ranks per node on ``cluster``: every "auto" resolved, and every
    request it cannot hold refused, naming what it has."""
    alive = cluster.alive_nodes()
    for name, value in (("nodes", nodes), ("workers_per_node", workers_per_node)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or 'auto'.")
    with_gpus = [n for n in alive if n.gpus >= 1]
    if device == "cuda" and not with_gpus:
        raise ValueError(
            f"device='cuda' but no node of the cluster has a GPU ({_has(alive)}). Use device='cpu'."
        )
    resolved: Literal["cuda", "cpu"] = (
        "cuda"
        if device == "cuda" or (device == "auto" and with_gpus and len(with_gpus) == len(alive))
        else "cpu"
    )

    def capacity(node: NodeInfo) -> int:
        return int(node.gpus if resolved == "cuda" else node.cpus)

    usable = [n for n in alive if capacity(n) >= 1]
    if workers_per_node == "auto":
        per_node = min((capacity(n) for n in usable), default=0) if resolved == "cuda" else 1
    else:
        per_node = int(workers_per_node)
    able = [n for n in usable if capacity(n) >= per_node]
    count = len(able) if nodes == "auto" else int(nodes)
    if per_node < 1 or count > len(able) or count < 1:
        unit = "GPU" if resolved == "cuda" else "CPU"
        raise ValueError(
            f"nodes={nodes!r} with workers_per_node={per_node} ({unit}s per node) does not fit "
            f"the cluster: {len(able)} alive node(s) can hold {per_node} rank(s) each "
            f"({_has(alive)}). Ask for fewer nodes or ranks per node."
        )
    if num_workers != "auto" and num_workers != count * per_node:
        raise ValueError(
            f"num_workers={num_workers!r} but nodes={count} x workers_per_node={per_node} "
            f"is {count * per_node}: give num_workers={count * per_node}, or leave it 'auto'."
        )
    return resolved, count, per_node


def _has(nodes: list[NodeInfo]) -> str:
    if not nodes:
        return "no alive node"
    return ", ".join(f"{n.address}: {n.cpus:g} CPUs, {n.gpus:g} GPUs" for n in nodes)
