"""Session cells: how long a cell on ranks that stay up takes, from a real Jupyter kernel.

    python benchmarks/session.py [--quick]
    python benchmarks/session.py --tasks [N]   # session.run of an empty function, no kernel

Each case is one cell sent by jupyter_client to a running IPython kernel, timed from the
request to the reply (what a user waits for), on 2 CPU ranks that were started beforehand:

* nbddp: ``%%ddp --session --display none`` with an empty body, and with one all_reduce; the
  same two with the default display (the live panel appears per cell);
* nbdistributed 0.1.0 (``pip install nbdistributed``), if installed: ``%%distributed`` with
  the same bodies, in a kernel of its own, ``%dist_init -n 2 -a 127.0.0.1``. Its first cell
  after ``%dist_init`` timed out (30 s) on this machine every time; the cells after it work,
  so two warm-up cells run first, for both tools;
* a fresh-process ``%%ddp -n 2 --display none`` launch of the same all_reduce, for scale.

Kernels interleave cell by cell; medians. Target: an empty session cell ≤ 30 ms.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

ALLREDUCE = "t = torch.ones(1)\ntorch.distributed.all_reduce(t)\n"
CASES = {
    "nbddp": {
        "empty": "%%ddp --session --display none\npass\n",
        "all_reduce": "%%ddp --session --display none\n" + ALLREDUCE,
        "empty, live panel": "%%ddp --session\npass\n",
        "all_reduce, live panel": "%%ddp --session\n" + ALLREDUCE,
        "all_reduce, fresh-process %%ddp launch": "%%ddp -n 2 --device cpu --display none\n"
        + ALLREDUCE,
    },
    "nbdistributed": {
        "empty": "%%distributed\npass\n",
        "all_reduce": "%%distributed\n" + ALLREDUCE,
    },
}
SETUP = {
    "nbddp": "import torch, nbddp\n%load_ext nbddp\n%ddp_session start -n 2 --device cpu",
    "nbdistributed": "import torch\n%load_ext nbdistributed\n%dist_init -n 2 -a 127.0.0.1",
}
TEARDOWN = {"nbddp": "%ddp_session stop", "nbdistributed": "%dist_shutdown"}


def run(quick: bool = False) -> str:
    from conftest import Kernel

    # nbdistributed starts its workers as `python` from PATH: make that this interpreter
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    rounds = 5 if quick else 30
    tools = ["nbddp"]
    if importlib.util.find_spec("nbdistributed") is not None:
        tools.append("nbdistributed")
    kernels = {}
    try:
        for tool in tools:
            kernels[tool] = Kernel()
            out, reply = kernels[tool].run(SETUP[tool], timeout=120)
            if reply["status"] != "ok":
                raise RuntimeError(f"{tool} did not start: {out[-2000:]}")
            # warm up: nbdistributed's first cell after %dist_init times out (30 s) here
            kernels[tool].run(CASES[tool]["all_reduce"], timeout=120)
            kernels[tool].run(CASES[tool]["all_reduce"], timeout=120)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for tool in tools:
                for case, source in CASES[tool].items():
                    started = time.perf_counter()
                    out, reply = kernels[tool].run(source)
                    elapsed = time.perf_counter() - started
                    if reply["status"] != "ok" or "Error" in out:
                        raise RuntimeError(f"{tool} {case}: {out[-2000:]}")
                    times.setdefault((tool, case), []).append(elapsed)
        baseline = []
        for _ in range(rounds):
            started = time.perf_counter()
            kernels["nbddp"].run("pass")
            baseline.append(time.perf_counter() - started)
    finally:
        for tool, kernel in kernels.items():
            kernel.run(TEARDOWN[tool])
            kernel.shutdown()
    rows = [
        "| cell (2 CPU ranks already up) | median (ms) |",
        "| --- | ---: |",
        f"| a plain `pass` cell (the kernel round trip itself) | "
        f"{statistics.median(baseline) * 1000:.1f} |",
    ]
    for (tool, case), values in times.items():
        rows.append(f"| {tool}: {case} | {statistics.median(values) * 1000:.1f} |")
    if "nbdistributed" not in tools:
        rows.append("| nbdistributed | not installed (pip install nbdistributed) |")
    empty = statistics.median(times[("nbddp", "empty")]) * 1000
    rows += [
        "",
        f"An empty `%%ddp --session` cell: {empty:.1f} ms from request to reply (target ≤ 30 "
        f"ms); medians of {rounds}, kernels interleaved cell by cell.",
    ]
    return "\n".join(rows)


def empty() -> None:
    pass


def tasks(count: int = 300) -> str:
    """The latency of an empty task, ``session.run(empty)`` on 2 CPU ranks already up, as a
    distribution: what every session task costs before any user code (the wire, the ranks'
    bookkeeping, the judging), without a kernel's round trip on top."""
    import nbddp

    times = []
    with nbddp.Session(num_workers=2, device="cpu") as session:
        for _ in range(20):  # warm up
            session.run(empty, display="none")
        for _ in range(count):
            started = time.perf_counter()
            session.run(empty, display="none")
            times.append((time.perf_counter() - started) * 1000)
    times.sort()

    def at(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))]

    return (
        f"| empty task, {count} runs | {at(0.5):.2f} | {at(0.9):.2f} | {at(0.99):.2f} | "
        f"{times[-1]:.2f} |"
    )


if __name__ == "__main__":
    if "--tasks" in sys.argv:
        rest = sys.argv[sys.argv.index("--tasks") + 1 :]
        print("| session.run (ms) | p50 | p90 | p99 | max |\n| --- | ---: | ---: | ---: | ---: |")
        print(tasks(int(rest[0]) if rest else 300))
    else:
        print(run("--quick" in sys.argv))
