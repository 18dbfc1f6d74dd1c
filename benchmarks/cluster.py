"""Launches on a running two-node Ray cluster (``ray.cluster_utils``: two raylets on this
machine on 127.0.0.2, one CPU each; one gloo rank per node, a trivial all_reduce):

* nbddp's first launch (it starts the node helpers) and repeated launches, 0.3 s apart as
  cells are;
* Ray Train's ``TorchTrainer(...).fit()`` doing the same all_reduce, every fit fresh (it
  starts its worker actors each time), on the same cluster, interleaved;
* how long a raising rank takes to reach the kernel as an error.

    python benchmarks/cluster.py [--quick]     (needs pip install "ray[train]")

Targets: a repeated launch ≤ 0.5 s and ≥ 5× faster than a fresh ``TorchTrainer.fit``; a
failure noticed within 1 s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

NODE_IP = "127.0.0.2"  # loopback: Ray rewrites 127.0.0.1 to the machine's outward address


def _allreduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _train_loop(config: dict) -> None:  # Ray Train's worker function: the same all_reduce
    _allreduce()


def _fails() -> None:
    import nbddp

    if nbddp.rank() == 1:
        raise RuntimeError(f"raised at {time.time()!r}")
    time.sleep(60)


def run(quick: bool = False) -> str:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    import nbddp

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": NODE_IP, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, node_ip_address=NODE_IP)
    ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=NODE_IP)
    storage = tempfile.mkdtemp(prefix="nbddp-bench-ray-train-")  # Ray Train's run records
    try:
        rounds = 3 if quick else 10
        options = {"cluster": "ray", "device": "cpu", "display": "none"}
        started = time.perf_counter()
        nbddp.notebook_launch(_allreduce, **options)
        first = time.perf_counter() - started
        ours, theirs = [], []
        try:
            from ray.train import RunConfig, ScalingConfig
            from ray.train.torch import TorchTrainer
        except ImportError:
            TorchTrainer = None
        for _ in range(rounds):
            time.sleep(0.3)
            started = time.perf_counter()
            nbddp.notebook_launch(_allreduce, **options)
            ours.append(time.perf_counter() - started)
            if TorchTrainer is not None:
                started = time.perf_counter()
                TorchTrainer(
                    _train_loop,
                    scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(storage_path=storage),
                ).fit()
                theirs.append(time.perf_counter() - started)
        noticed = []
        for _ in range(3):
            time.sleep(0.3)
            try:
                nbddp.notebook_launch(_fails, **options)
            except nbddp.WorkerError as error:
                raised_at = float(error.exc_message.split(" at ")[1])
                noticed.append(time.time() - raised_at)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    ours_median = statistics.median(ours)
    rows = [
        "| on a running 2-node cluster, 2 gloo ranks | first (s) | repeated (s, median) |",
        "| --- | ---: | ---: |",
        f'| nbddp `notebook_launch(..., cluster="ray")` | {first:.2f} | {ours_median:.3f} |',
    ]
    if theirs:
        theirs_median = statistics.median(theirs[1:] or theirs)
        rows.append(
            f"| Ray Train `TorchTrainer.fit()` (new training workers every fit) | {theirs[0]:.2f} "
            f"| {theirs_median:.2f} |"
        )
        ratio = (
            f"; first against first nbddp is {theirs[0] / first:.1f}× faster, repeated against "
            f"repeated {theirs_median / ours_median:.0f}× (target ≥ 5×): nbddp keeps each node's "
            "helper warm between launches, Ray Train keeps nothing warm between fits"
        )
    else:
        ratio = " (Ray Train not installed: pip install 'ray[train]')"
    rows += [
        "",
        f"Repeated launch {ours_median:.3f} s (target ≤ 0.5 s){ratio}; medians of {rounds}, "
        "0.3 s apart, interleaved. The first launch starts each node's helper (a fresh "
        "interpreter importing torch). A raising rank reached the kernel as a WorkerError "
        f"{statistics.median(noticed) * 1000:.0f} ms after it raised (median of 3; "
        "target ≤ 1 s).",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
