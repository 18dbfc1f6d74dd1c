"""Back-to-back launches on a Ray cluster (issue #26): as fast as spaced ones?

    python benchmarks/ray_relaunch.py [--launches 7]

A two-node simulated cluster on this machine (127.0.0.2, one CPU each), one gloo rank per node,
a trivial ``fn``. Launches back to back and 0.7 s apart, with the reservation kept between
launches (nbddp now) and with ``KEEP_RESERVATION = 0`` (removed at once, as before #26: the
next launch's placement group waits for Ray to see the resources free), interleaved in blocks.
Prints the median and max of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

NODE_IP = "127.0.0.2"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=7)
    args = parser.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    import nbddp
    from nbddp.clusters import choice
    from nbddp.clusters.ray import cluster as ray_cluster

    simulated = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": NODE_IP, "include_dashboard": False},
    )
    simulated.add_node(num_cpus=1, node_ip_address=NODE_IP)
    ray.init(address=simulated.address, log_to_driver=False, _node_ip_address=NODE_IP)
    options = {"cluster": "ray", "display": "none", "device": "cpu", "num_workers": 2}
    kept = ray_cluster.KEEP_RESERVATION
    times: dict[tuple[str, str], list[float]] = {}
    try:
        nbddp.notebook_launch(abs, (-1,), **options)  # node helpers up and warm
        for _ in range(2):
            for label, keep in (("kept (now)", kept), ("removed at once (before)", 0.0)):
                ray_cluster.KEEP_RESERVATION = keep
                for mode, pause in (("back to back", 0.0), ("0.7 s apart", 0.7)):
                    time.sleep(1.0)  # each block from a quiet cluster
                    for _ in range(args.launches):
                        started = time.perf_counter()
                        nbddp.notebook_launch(abs, (-1,), **options)
                        times.setdefault((label, mode), []).append(time.perf_counter() - started)
                        time.sleep(pause)
    finally:
        ray_cluster.KEEP_RESERVATION = kept
        for registered in {choice._default, *ray_cluster._by_address.values()} - {None}:
            registered.release_reservations()
        ray.shutdown()
        simulated.shutdown()
    print("| reservation | launches | n | p50 s | max s |")
    print("|---|---|---|---:|---:|")
    for (label, mode), values in times.items():
        print(
            f"| {label} | {mode} | {len(values)} | {statistics.median(values):.2f} "
            f"| {max(values):.2f} |"
        )


if __name__ == "__main__":
    main()
