"""Repeated two-node launch latency on Slurm, next to Ray's (issue #22).

    sudo python benchmarks/slurm_latency.py [--launches 30] [--no-ray]

Slurm: the test cluster of ``tests/slurm_cluster.py`` (``slurmctld`` and two ``slurmd`` in two
network namespaces on this machine, 10.201.0.1 and .2); the kernel is a Python process in node
A's namespace under ``salloc --nodes=2`` (``cluster="slurm"``). Ray: two simulated nodes
(``ray.cluster_utils``, 127.0.0.2, one CPU each). Both: one gloo rank per node, a trivial
all_reduce, the node helpers already warm (a first launch untimed), then ``--launches``
launches 0.3 s apart, as cells are. Prints p50/p90/p99/max of each, and the first launch (which
starts the helpers). Needs root and Slurm's packages (and Ray for its half).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KERNEL = """
import json, sys, time
import nbddp

def allreduce():
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

options = {OPTIONS}
started = time.perf_counter()
assert nbddp.notebook_launch(allreduce, **options) == 2.0
first = time.perf_counter() - started
times = []
for _ in range({LAUNCHES}):
    time.sleep(0.3)
    started = time.perf_counter()
    assert nbddp.notebook_launch(allreduce, **options) == 2.0
    times.append(time.perf_counter() - started)
print("RESULT " + json.dumps([first, times]))
"""


def percentiles(times: list[float]) -> str:
    ordered = sorted(times)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return (
        f"p50 {at(0.5) * 1000:.0f} ms, p90 {at(0.9) * 1000:.0f} ms, "
        f"p99 {at(0.99) * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms (n={len(times)})"
    )


def kernel_code(options: dict[str, object], launches: int) -> str:
    return (
        textwrap.dedent(KERNEL)
        .replace("{OPTIONS}", repr(options))
        .replace("{LAUNCHES}", str(launches))
    )


def result_of(stdout: str, stderr: str) -> tuple[float, list[float]]:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            first, times = json.loads(line[7:])
            return first, times
    raise SystemExit(f"no result:\n{stdout}\n{stderr}")


def on_slurm(launches: int) -> tuple[float, list[float]]:
    from slurm_cluster import slurm_cluster, why_not

    reason = why_not()
    if reason is not None:
        raise SystemExit(f"no test Slurm: {reason}")
    os.environ["PYTHONPATH"] = str(ROOT)  # the cluster's commands inherit it
    with tempfile.TemporaryDirectory() as folder, slurm_cluster(Path(folder) / "slurm") as slurm:
        script = Path(folder) / "kernel.py"
        options = {"cluster": "slurm", "display": "none"}
        script.write_text(kernel_code(options, launches))
        command = ["salloc", "--nodes=2", "--quiet", sys.executable, str(script)]
        done = slurm.run(command, timeout=600, cwd=folder)
        return result_of(done.stdout, done.stderr)


def on_ray(launches: int) -> tuple[float, list[float]]:
    code = f"""
import os
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
import ray
from ray.cluster_utils import Cluster
simulated = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1,
    "node_ip_address": "127.0.0.2", "include_dashboard": False}})
simulated.add_node(num_cpus=1, node_ip_address="127.0.0.2")
ray.init(address=simulated.address, log_to_driver=False, _node_ip_address="127.0.0.2")
try:
{textwrap.indent(kernel_code({"cluster": "ray", "display": "none"}, launches), "    ")}
finally:
    ray.shutdown()
    simulated.shutdown()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    return result_of(done.stdout, done.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load {load:.1f} at the start")
    engines = [("Slurm", on_slurm)] + ([] if args.no_ray else [("Ray", on_ray)])
    for name, measure in engines:
        started = time.monotonic()
        first, times = measure(args.launches)
        print(f"{name}: first launch {first:.2f} s (starts the node helpers)")
        print(f"{name}: repeated, 0.3 s apart: {percentiles(times)}")
        print(f"  ({time.monotonic() - started:.0f} s with the cluster's start and end)")


if __name__ == "__main__":
    main()
