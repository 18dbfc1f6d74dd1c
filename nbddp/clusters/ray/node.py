"""A Ray node's helper: :class:`~nbddp.clusters.nodes.NodeCore` as a Ray actor.

One per node and kernel (see ``cluster.py``): owned by the kernel's driver, never detached,
so it dies with the kernel. Its address is the one Ray knows the node by. No port is opened
for the kernel, which may be a laptop on ``ray://``: the kernel polls it through Ray.
"""

from __future__ import annotations

from nbddp.clusters.nodes import NodeCore


class NodeHelper(NodeCore):
    """The actor's class (made remote by ``cluster.py``)."""

    def __init__(self) -> None:
        import ray

        super().__init__(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class GpuLease:
    """Holds one reservation bundle's GPUs on its node for the ranks nbddp starts there
    (``cluster.lease_gpus``), and says which Ray gave it."""

    def ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]]
