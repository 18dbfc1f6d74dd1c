"""A detached run's batch job on Slurm: its shape (device, nodes, ranks per node) and the
``sbatch`` options that ask for it, before anything is submitted.

Inside an allocation the shape is placed on it (and the job asks for the same partition and
account); from a login node it is read from the options alone, since no allocation exists yet.

Non-goal: submitting the job (``detached/batch.py``).
"""

from __future__ import annotations

import os
from typing import Literal

from nbddp.clusters.placement import place_on_cluster
from nbddp.clusters.slurm.allocation import SlurmCluster

# what a batch job submitted from inside an allocation asks for as that allocation did
_INHERITED = (("partition", "SLURM_JOB_PARTITION"), ("account", "SLURM_JOB_ACCOUNT"))


def batch_shape(
    cluster: SlurmCluster,
    num_workers: int | str,
    device: str,
    nodes: int | str,
    workers_per_node: int | str,
) -> tuple[Literal["cuda", "cpu"], int, int, list[str]]:
    """A detached run's batch job: its device, nodes, ranks per node and sbatch's options.
    Inside an allocation, the shape is placed on it (and the job asks for the same);
    otherwise it is read from the options alone, since no allocation exists yet."""
    if not cluster._owned:
        resolved, count, per_node = place_on_cluster(
            cluster, num_workers, device, nodes, workers_per_node
        )
        options = [
            f"--{name}={os.environ[variable]}"
            for name, variable in _INHERITED
            if os.environ.get(variable)
        ]
    else:
        resolved, count, per_node = _shape_without_allocation(
            cluster, num_workers, device, nodes, workers_per_node
        )
        options = [o for o in cluster._options if not o.startswith("--nodes=")]
    options = [o for o in options if not o.startswith("--gpus-per-node=")]
    options += [f"--nodes={count}", "--ntasks-per-node=1"]
    if resolved == "cuda":
        options.append(f"--gpus-per-node={per_node}")
    if per_node > 1 and not any(o.startswith("--cpus-per-task=") for o in options):
        options.append(f"--cpus-per-task={per_node}")  # a CPU per rank at least
    return resolved, count, per_node, list(dict.fromkeys(options))


def _shape_without_allocation(
    cluster: SlurmCluster,
    num_workers: int | str,
    device: str,
    nodes: int | str,
    workers_per_node: int | str,
) -> tuple[Literal["cuda", "cpu"], int, int]:
    for name, value in (("nodes", nodes), ("workers_per_node", workers_per_node)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or 'auto'.")
    gpus = cluster.gpus_per_node or 0
    resolved: Literal["cuda", "cpu"] = (
        "cuda" if device == "cuda" or (device == "auto" and gpus) else "cpu"
    )
    if resolved == "cuda" and not gpus:
        raise ValueError(
            "device='cuda' for a detached run on Slurm: say how many GPUs each node has, "
            "nbddp.SlurmCluster(gpus_per_node=N) (no allocation exists yet to ask)."
        )
    count = int(nodes) if nodes != "auto" else (cluster.nodes or 1)
    if workers_per_node != "auto":
        per_node = int(workers_per_node)
    else:
        per_node = gpus if resolved == "cuda" else 1
    if resolved == "cuda" and per_node > gpus:
        raise ValueError(f"workers_per_node={per_node} but gpus_per_node={gpus}: one rank per GPU.")
    if num_workers != "auto" and num_workers != count * per_node:
        raise ValueError(
            f"num_workers={num_workers!r} but nodes={count} x workers_per_node={per_node} "
            f"is {count * per_node}: give num_workers={count * per_node}, or leave it 'auto'."
        )
    return resolved, count, per_node
