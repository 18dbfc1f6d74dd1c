"""A rank's exit work (#24): what it costs a rank that registered nothing.

    python benchmarks/exit_work.py [LAUNCHES]

After its result, a rank that ended normally joins its non-daemon threads, runs its ``atexit``
handlers and ends the processes it started (``worker/exiting.exit_normally``), then
``os._exit``. Here each rank of LAUNCHES warm launches (8 by default; 2 CPU ranks, gloo, a
trivial all_reduce) times that stretch itself: ``fn`` wraps the rank's ``exit_normally`` and
``os._exit``, and writes the main thread's CPU time (``time.thread_time()``) and the wall time
from the start of the exit work to ``os._exit`` to a file, just before the exit. Prints
Markdown for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import nbddp


def timed_exit(folder: str) -> int:
    """A trivial DDP step whose rank then times its own exit work."""
    import torch
    import torch.distributed as dist

    from nbddp.worker.rank import entry

    exit_work, leave = entry.exit_normally, os._exit

    def exit_normally(*args: object) -> None:
        cpu, wall = time.thread_time(), time.monotonic()

        def _exit(code: int) -> None:
            took = {"cpu": time.thread_time() - cpu, "wall": time.monotonic() - wall}
            with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
                json.dump(took, f)
            leave(code)

        os._exit = _exit  # type: ignore[assignment]
        exit_work(*args)  # type: ignore[arg-type]

    entry.exit_normally = exit_normally  # type: ignore[assignment]
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    options = {"num_workers": 2, "device": "cpu", "display": "none"}
    nbddp.notebook_launch(abs, (-1,), **options)  # the helper warm
    took: dict[str, list[float]] = {"cpu": [], "wall": []}
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as folder:
            assert nbddp.notebook_launch(timed_exit, (folder,), **options) == 2
            files = os.listdir(folder)
            assert len(files) == 2, files  # each rank ran its exit work and timed it
            for name in files:
                with open(os.path.join(folder, name)) as f:
                    for key, value in json.load(f).items():
                        took[key].append(value)
    print("| a rank's exit work (ms) | p50 | p90 | max | rank exits |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key, label in (("cpu", "main thread's CPU time"), ("wall", "wall time")):
        values = took[key]
        cells = [statistics.median(values), _pct(values, 0.9), max(values)]
        row = " | ".join(f"{v * 1e3:.2f}" for v in cells)
        print(f"| {label} | {row} | {len(values)} |")


if __name__ == "__main__":
    main()
