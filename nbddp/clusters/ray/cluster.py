"""Ray clusters, the kernel's side: the connection, what the cluster has, and one node helper
per node.

``cluster="ray"`` is the Ray cluster this kernel is connected to (``ray.init(address="auto")``
when Ray is not initialised yet), ``"ray://host:port"`` a remote one through Ray Client, and
:class:`RayCluster` gives full control (``runtime_env`` ships code the ranks import, e.g.
``{"working_dir": "."}`` or ``{"py_modules": [mymodule]}``). Ray is imported only here, and
only when a cluster is named: ``pip install "nbddp[ray]"``.

Each node gets one helper actor per kernel (``node.py``): pinned to the node, needing no CPU of
its own, owned by this kernel's driver (never detached: it dies with the kernel), and kept for
later launches, so only the first launch pays for its start. A detached run's supervisor
connects as a driver of its own (:class:`RayAddress`) and owns its run's helpers: they outlive
the kernel, and end with the supervisor.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

from nbddp.clusters.placement import NodeInfo

_lock = threading.Lock()
KEEP_RESERVATION = 5.0  # seconds a launch's reservation waits, idle, for the next launch
_by_address: dict[str, RayCluster] = {}


class RayCluster:
    """A Ray cluster to launch on, for ``cluster=`` (``cluster="ray"`` is ``RayCluster()``).

    Args:
        address: None for the cluster this kernel is connected to (or finds:
            ``ray.init(address="auto")``), ``"ray://host:port"`` for Ray Client.
        runtime_env: What Ray ships to every node for the ranks (``working_dir``,
            ``py_modules``, ``pip``, ...): a module the call needs by name that a node cannot
            import is named before anything starts, with this fix.
    """

    def __init__(self, address: str | None = None, runtime_env: dict[str, Any] | None = None):
        if address is not None and not isinstance(address, str):
            raise ValueError(
                f"RayCluster(address={address!r}): a string like 'ray://head:10001'"
                " or None (the cluster this kernel is connected to)."
            )
        self.address = address
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self._helpers: dict[str, Any] = {}
        self._infos: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._kept: dict[Any, tuple[Any, threading.Timer]] = {}  # shape: (placement, its end)

    def take_reservation(self, shape: Any) -> Any:
        """The placement group the last launch of this ``shape`` left (None if none): a new
        one made right after the last one's removal waits 0.5-1 s in Ray for the released
        resources, a kept one is ready. Reservations of other shapes go now: they would hold
        what this one needs."""
        with self._lock:
            kept = self._kept.pop(shape, None)
            others = list(self._kept.values())
            self._kept = {}
        for placement, timer in others:
            timer.cancel()
            _remove(placement)
        if kept is None:
            return None
        kept[1].cancel()
        return kept[0]

    def keep_reservation(self, shape: Any, placement: Any) -> None:
        """Keep a launch's placement group for the next launch of its shape, for
        ``KEEP_RESERVATION`` seconds: then it goes, and the cluster's resources are free."""
        timer = threading.Timer(KEEP_RESERVATION, self._release, (shape, placement))
        timer.daemon = True
        with self._lock:
            old = self._kept.pop(shape, None)
            self._kept[shape] = (placement, timer)
        if old is not None:
            old[1].cancel()
            _remove(old[0])
        timer.start()

    def release_reservations(self) -> None:
        """Remove every kept placement group now."""
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for placement, timer in kept:
            timer.cancel()
            _remove(placement)

    def _release(self, shape: Any, placement: Any) -> None:
        with self._lock:
            if self._kept.get(shape, (None,))[0] is not placement:
                return
            del self._kept[shape]
        _remove(placement)

    def __repr__(self) -> str:
        where = self.address or "the connected cluster"
        return f"RayCluster({where}{', runtime_env=...' if self.runtime_env else ''})"

    def connect(self) -> Any:
        """The ``ray`` module, connected. Raises ValueError with the fix when it cannot be."""
        try:
            import ray
        except ImportError:
            raise ValueError(
                "cluster=... needs Ray: pip install 'nbddp[ray]' (Ray is not installed in "
                "this kernel's environment)."
            ) from None
        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.address or "auto", log_to_driver=False, logging_level=logging.ERROR
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ValueError(
                    f"cannot reach a Ray cluster at {self.address or 'address=auto'} ({exc}). "
                    "Start one (`ray start --head` on this machine), connect first with "
                    "ray.init(...), or pass cluster='ray://host:10001'."
                ) from None
        return ray

    def reachable(self) -> RayAddress:
        """How another process of this user reaches this cluster as a driver of its own (a
        detached run's supervisor, which owns the ranks' helpers so that they outlive this
        kernel's driver)."""
        ray = self.connect()
        if self.address is not None and self.address.startswith("ray://"):
            return RayAddress(self.address, None, self.runtime_env)
        try:
            gcs = ray.get_runtime_context().gcs_address
        except Exception:  # Ray Client connected outside nbddp: no address to give
            gcs = None
        if not gcs:
            raise ValueError(
                "detach=True on Ray needs the cluster's address for the run's supervisor: pass "
                "cluster=nbddp.RayCluster('ray://host:10001') (or connect with "
                "ray.init(address=...) to the head node's address)."
            )
        return RayAddress(gcs, ray.util.get_node_ip_address(), self.runtime_env)

    def alive_nodes(self) -> list[NodeInfo]:
        ray = self.connect()
        nodes = []
        for node in ray.nodes():
            if node.get("Alive"):
                resources = node.get("Resources", {})
                nodes.append(
                    NodeInfo(
                        node["NodeID"],
                        node["NodeManagerAddress"],
                        float(resources.get("CPU", 0)),
                        float(resources.get("GPU", 0)),
                    )
                )
        return nodes

    def helper(self, node_id: str) -> Any:
        """The node's helper actor, started on first use."""
        with self._lock:
            helper = self._helpers.get(node_id)
            if helper is None:
                ray = self.connect()
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                from nbddp.clusters.ray.node import NodeHelper

                remote = ray.remote(NodeHelper)
                options: dict[str, Any] = {
                    "num_cpus": 0,
                    "max_concurrency": 16,  # poll, send_all and stop run side by side
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                }
                if self.runtime_env:
                    options["runtime_env"] = self.runtime_env
                helper = self._helpers[node_id] = remote.options(**options).remote()
            return helper

    def info(self, node_id: str) -> dict[str, Any]:
        """What the node's helper says of its node (address, interface, torch), cached."""
        if node_id not in self._infos:
            ray = self.connect()
            self._infos[node_id] = ray.get(self.helper(node_id).info.remote())
        return self._infos[node_id]

    def forget(self, node_id: str) -> None:
        """A helper that died or was killed: the next launch starts a new one."""
        with self._lock:
            self._helpers.pop(node_id, None)
            self._infos.pop(node_id, None)


def lease_gpus(placement: Any, nodes: int, per_node: int) -> list[tuple[str, ...]]:
    """The GPUs Ray gives each bundle of ``placement``, by bundle: a small actor in each
    bundle holds its GPUs for as long as the placement group lives, and says which they are.
    The node helpers hold no GPU (they live outside any launch's reservation), so Ray hides
    every GPU from them (``CUDA_VISIBLE_DEVICES=""``): without the lease their ranks would
    take GPUs 0..k-1 whatever Ray reserved, on a node where others hold GPU 0 too."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nbddp.clusters.ray.node import GpuLease

    key = placement.id.hex()
    with _lock:
        held = _leases.get(key)
    if held is None:
        remote = ray.remote(GpuLease)
        actors = [
            remote.options(
                num_cpus=0,
                num_gpus=per_node,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=index
                ),
            ).remote()
            for index in range(nodes)
        ]
        asked = [actor.ids.remote() for actor in actors]  # type: ignore[union-attr]
        ids = [tuple(found) for found in ray.get(asked)]
        held = (actors, ids)
        with _lock:
            _leases[key] = held
    return list(held[1])


_leases: dict[str, tuple[list[Any], list[tuple[str, ...]]]] = {}  # placement id: (actors, ids)


def _remove(placement: Any) -> None:
    import contextlib

    import ray
    from ray.exceptions import RayError
    from ray.util import remove_placement_group

    with _lock:
        held = _leases.pop(placement.id.hex(), None)
    for actor in held[0] if held is not None else ():
        with contextlib.suppress(RayError, ConnectionError):
            ray.kill(actor)
    with contextlib.suppress(RayError, ConnectionError):
        remove_placement_group(placement)


class RayAddress(NamedTuple):
    """A Ray cluster as another process reaches it: the GCS address (or "ray://..."), the
    address Ray knows this machine by (None through Ray Client), what ships to the nodes."""

    address: str
    node_ip: str | None
    runtime_env: dict[str, Any] | None

    def connect(self) -> RayCluster:
        """This process, connected to the cluster as a driver of its own: the cluster to launch
        on. What it starts there ends when this process does (Ray's owner rule)."""
        import ray

        if not ray.is_initialized():
            extra: dict[str, Any] = (
                {} if self.node_ip is None else {"_node_ip_address": self.node_ip}
            )
            ray.init(
                address=self.address, log_to_driver=False, logging_level=logging.ERROR, **extra
            )
        return RayCluster(self.address, self.runtime_env)


def named(cluster: str) -> RayCluster:
    """The cluster "ray" or "ray://host:port" names, one per name."""
    address = None if cluster == "ray" else cluster
    with _lock:
        return _by_address.setdefault(cluster, RayCluster(address))
