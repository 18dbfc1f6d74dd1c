"""Data in and out of a launch: what a captured dataset and a returned tensor cost.

    python benchmarks/data.py [--quick]

1. A notebook global of 1 GB (a torch tensor, then a numpy array) read by ``fn`` on 2 CPU
   ranks: launch time over the trivial launch, and the machine's memory in use (every
   process's anonymous memory and all shared memory: AnonPages + Shmem) above what it was
   before the launch, at its peak and while every rank holds the data. Next to Accelerate's
   fork-based launcher, which shares the kernel's memory copy-on-write, on the same data.
2. A 1 GiB tensor returned by rank 0: the kernel's peak memory over the tensor's size, and
   the time, next to copying the same tensor within the kernel.

Each case runs in a fresh process (its own peak), interleaved.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from child import MEMORY_PROBE, run_child

HERE = Path(__file__).parent
GB = 10**9

_CASE = (
    MEMORY_PROBE
    + r"""
import json, sys, threading, time
import numpy as np, torch

launcher, kind, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "tensor":
    data = torch.ones(size // 4)
elif kind == "array":
    data = np.ones(size // 8)
else:
    data = None

def fn():
    import torch.distributed as dist
    total = float(data.sum()) if data is not None else 0.0  # every page read on every rank
    dist.barrier()
    held = used()
    dist.barrier()
    return total, held

if launcher == "nbddp":
    import nbddp
    from nbddp.local import forkserver
    forkserver.prestart(); forkserver.wait_until_ready(60)
    nbddp.notebook_launch(abs, (-1,), num_workers=2, device="cpu", display="none")
    launch = lambda: nbddp.notebook_launch(fn, num_workers=2, device="cpu", display="none")
else:
    from accelerate import notebook_launcher
    out = {}
    def wrapped():
        from accelerate import Accelerator
        Accelerator(cpu=True)
        value = fn()
        import torch.distributed as dist
        if dist.get_rank() == 0:
            out_file.write(json.dumps(value)); out_file.flush()
    import tempfile
    out_file = tempfile.NamedTemporaryFile("w+", delete=False)
    def launch():
        out_file.seek(0); out_file.truncate()  # each launch's rank 0 writes its own value
        notebook_launcher(wrapped, num_processes=2)
        out_file.seek(0)
        return json.loads(out_file.read())
time.sleep(1)
before = settled()
peak = [before]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], used()); time.sleep(0.005)
sampler = threading.Thread(target=sample); sampler.start()
started = time.perf_counter()
total, held = launch()
seconds = time.perf_counter() - started
stop.set(); sampler.join()
time.sleep(1)
started = time.perf_counter()
launch()
again = time.perf_counter() - started
print("RESULT " + json.dumps({"seconds": seconds, "again": again, "peak": peak[0] - before,
                              "held": held - before}))
"""
)

_RETURN = r"""
import json, sys, time
import torch, nbddp
from nbddp.local import forkserver
forkserver.prestart(); forkserver.wait_until_ready(60)
nbddp.notebook_launch(abs, (-1,), num_workers=2, device="cpu", display="none")
size = int(sys.argv[1])
def hwm():
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024
def big():
    return torch.ones(size // 4) if nbddp.rank() == 0 else None
time.sleep(1)
before = hwm()
started = time.perf_counter()
value = nbddp.notebook_launch(big, num_workers=2, device="cpu", display="none")
seconds = time.perf_counter() - started
grown = hwm() - before
started = time.perf_counter()
copy = value.clone()
copied = time.perf_counter() - started
print("RESULT " + json.dumps({"seconds": seconds, "grown": grown, "copy": copied}))
"""


def _run(script: str, *args: str) -> dict[str, float]:
    return run_child(script, *args)


def capture(rounds: int, size: int) -> str:
    cases = [
        ("nbddp", "none"),
        ("nbddp", "tensor"),
        ("nbddp", "array"),
        ("accelerate", "none"),
        ("accelerate", "tensor"),
    ]
    results: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(rounds):
        for launcher, kind in cases:
            results[(launcher, kind)].append(_run(_CASE, launcher, kind, str(size)))

    def median(case: tuple[str, str], key: str) -> float:
        return statistics.median(r[key] for r in results[case])

    rows = [
        "| launcher, captured data | first launch (s) | over trivial | next launch (s) "
        "| over trivial | memory while running | peak memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for launcher, kind in cases:
        cells = []
        for key in ("seconds", "again"):
            trivial, seconds = median((launcher, "none"), key), median((launcher, kind), key)
            cells += [f"{seconds:.2f}", "" if kind == "none" else f"{seconds - trivial:+.2f}"]
        held, peak = median((launcher, kind), "held"), median((launcher, kind), "peak")
        label = f"{launcher}, {'trivial fn' if kind == 'none' else f'1 GB {kind}'}"
        rows.append(
            f"| {label} | {' | '.join(cells)} | {held / GB:.2f} GB ({held / size:.2f}×) "
            f"| {peak / GB:.2f} GB ({peak / size:.2f}×) |"
        )
    rows += [
        "",
        "Memory: the whole machine's (AnonPages + Shmem: every process's own memory and all "
        "shared memory) above its level before the launch, over the data's size "
        f"({size / GB:.0f} GB in the kernel already); medians of "
        f"{rounds} fresh processes. Targets (nbddp): launch ≤ 0.5 s over the trivial one, "
        "while running ≤ 1.2×, peak ≤ 1.5×. The next launch captures the same data again from "
        "the same process, as a notebook's next cell would.",
    ]
    return "\n".join(rows)


def returned(rounds: int, size: int) -> str:
    runs = [_run(_RETURN, str(size)) for _ in range(rounds)]
    seconds = statistics.median(r["seconds"] for r in runs)
    grown = statistics.median(r["grown"] for r in runs)
    copy = statistics.median(r["copy"] for r in runs)
    return (
        f"A {size / 2**30:.0f} GiB tensor returned by rank 0 of 2: the launch took {seconds:.2f} "
        f"s; the kernel's peak memory grew by {grown / size:.2f}× the tensor's size (target "
        f"≤ 1.1×). Copying the same tensor within the kernel (`clone()`) takes {copy:.2f} s. "
        f"Medians of {rounds} fresh processes."
    )


def run(quick: bool = False) -> str:
    rounds = 1 if quick else 3
    return (
        "### Captured data (notebook global read by fn)\n\n"
        + capture(rounds, GB)
        + "\n\n### A returned tensor\n\n"
        + returned(rounds, 2**30)
    )


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
