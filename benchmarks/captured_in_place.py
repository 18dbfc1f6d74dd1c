"""A captured 1 GiB tensor shared in place (issue #26): what the first and the next launches
cost over a trivial one, and the machine's memory at rest and while the ranks hold the data.

    python benchmarks/captured_in_place.py [--rounds 3] [--gib 1]

Cases, each in a fresh process, interleaved over ``--rounds`` rounds: a trivial ``fn``; a
1 GiB tensor read by ``fn`` on 2 CPU ranks (shared in place: the default); the same with
``NBDDP_SHARE_IN_PLACE=0`` (a copy per launch, as before #26); a 1 GiB NumPy array (a copy per
launch). Memory is the whole machine's AnonPages + Shmem above its level before the data was
made (so the kernel's own copy counts): after the first launch ("at rest") and while every
rank of the next launch has read every page ("running"). The machine is shared with other
work: medians, and the memory level waits to settle before each case.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from child import MEMORY_PROBE, run_child

ROOT = Path(__file__).parent.parent

_CASE = (
    MEMORY_PROBE
    + r"""
import json, sys, time
import numpy as np, torch, nbddp
from nbddp.local import forkserver

kind, size = sys.argv[1], int(sys.argv[2])
forkserver.prestart(); forkserver.wait_until_ready(60)
nbddp.notebook_launch(abs, (-1,), num_workers=2, device="cpu", display="none")
base = settled()
if kind == "array":
    data = np.ones(size // 8)
elif kind == "none":
    data = None
else:
    data = torch.ones(size // 4)

def fn():
    import torch.distributed as dist
    total = float(data.sum()) if data is not None else 0.0  # every page read on every rank
    dist.barrier()
    held = used()
    dist.barrier()
    return total, held

def launch():
    started = time.perf_counter()
    _, held = nbddp.notebook_launch(fn, num_workers=2, device="cpu", display="none")
    return time.perf_counter() - started, held

first, _ = launch()
time.sleep(1)
rest = settled()
second, held = launch()
time.sleep(1)
third, _ = launch()
print("RESULT " + json.dumps({"first": first, "next": min(second, third),  # best of two
                              "rest": rest - base, "running": held - base}))
"""
)

CASES = [
    ("trivial fn", "none", {}),
    ("1 GiB tensor, in place", "tensor", {}),
    ("1 GiB tensor, NBDDP_SHARE_IN_PLACE=0", "tensor", {"NBDDP_SHARE_IN_PLACE": "0"}),
    ("1 GiB NumPy array", "array", {}),
]


def _run(kind: str, size: int, env: dict[str, str]) -> dict[str, float]:
    return run_child(_CASE, kind, str(size), env={"PYTHONPATH": str(ROOT), **env})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    size = int(args.gib * 2**30)
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in CASES}
    for _ in range(args.rounds):
        for label, kind, env in CASES:
            results[label].append(_run(kind, size, env))

    def median(label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[label])

    print(
        "| captured | first launch s | over trivial | next launch s (best of 2) | over trivial "
        "| memory at rest | memory running |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, kind, _ in CASES:
        cells = []
        for key in ("first", "next"):
            value, trivial = median(label, key), median("trivial fn", key)
            cells += [f"{value:.2f}", "" if kind == "none" else f"{value - trivial:+.2f}"]
        memory = [f"{median(label, k) / size:.2f}×" for k in ("rest", "running")]
        print(f"| {label} | {' | '.join(cells)} | {' | '.join(memory)} |")
    print(f"\nMedians of {args.rounds} fresh processes; memory over the data's size.")


if __name__ == "__main__":
    main()
