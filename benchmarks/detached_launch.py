"""Launch latency of a detached run against an attached one (issue #34).

    python benchmarks/detached_launch.py [--launches 40] [--pause 0.3]

A trivial 2-rank all_reduce on the CPU, launched alternately attached
(``notebook_launch(..., block=False)``) and detached (``detach=True``) from one process with
the pre-warmed helper ready, as in a kernel; ``--pause`` seconds between launches. Two
numbers per launch: until ``notebook_launch`` returns (what the cell waits for; the ranks are
started by then), and until ``result()`` (the whole run of an empty function). Each detached
run is forgotten afterwards. Prints a markdown table of p50 / p90 / p99 / max in ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trivial() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=40)
    parser.add_argument("--pause", type=float, default=0.3)
    args = parser.parse_args()
    runs_dir = tempfile.mkdtemp(prefix="nbddp-bench-runs-")  # removed at the end
    os.environ["NBDDP_RUNS_DIR"] = runs_dir
    try:
        measure(args.launches, args.pause)
    finally:
        from nbddp.detached.spawn import standby

        standby.discard()  # the supervisor standing by for a next launch
        shutil.rmtree(runs_dir, ignore_errors=True)


def measure(launches: int, pause: float) -> None:
    import nbddp
    from nbddp.local import forkserver

    forkserver.prestart()
    assert forkserver.wait_until_ready(120), "the pre-warmed helper did not start"
    options = {"num_workers": 2, "device": "cpu", "display": "none"}
    for detach in (False, True):  # warm-up: imports, the helper's pool
        nbddp.notebook_launch(trivial, block=False, detach=detach, **options).result()
    times: dict[str, dict[str, list[float]]] = {
        name: {"return": [], "result": []} for name in ("attached", "detached")
    }
    for _ in range(launches):
        for name, detach in (("attached", False), ("detached", True)):
            time.sleep(pause)
            start = time.perf_counter()
            run = nbddp.notebook_launch(trivial, block=False, detach=detach, **options)
            returned = time.perf_counter()
            assert run.result(timeout=120) == 2.0
            done = time.perf_counter()
            times[name]["return"].append(returned - start)
            times[name]["result"].append(done - start)
            if detach:
                run.forget()
    print("| launch | until | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for name, measured in times.items():
        for until, values in measured.items():
            print(
                f"| {name} | {'notebook_launch returns' if until == 'return' else 'result()'} "
                f"| {len(values)} | {1000 * _quantile(values, 0.5):.0f} | "
                f"{1000 * _quantile(values, 0.9):.0f} | {1000 * _quantile(values, 0.99):.0f} | "
                f"{1000 * max(values):.0f} |"
            )


if __name__ == "__main__":
    main()
