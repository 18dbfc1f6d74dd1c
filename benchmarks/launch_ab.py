"""Warm launch latency of two nbddp trees, interleaved: is a change free for a launch?

    python benchmarks/launch_ab.py OTHER_TREE [ROUNDS] [LAUNCHES]

Compares this tree with ``OTHER_TREE`` (e.g. a ``git worktree`` of the commit before a change)
on the launch of a function that does nothing but a trivial all_reduce on 2 CPU ranks, with
the pre-warmed helper. Each round starts one fresh process per tree (alternating which goes
first), lets the helper warm up, launches once untimed, then times ``LAUNCHES`` launches 0.3 s
apart, as cells are. Prints each tree's p50/p90/p99/max over all rounds: on a shared machine
the rounds interleave the trees, so the load they see is the same. Also the part of a launch
from a rank's result to its exit, as the kernel sees them (wrapping the referee's ``event``):
what a change to how ranks end costs, without the rest of the launch's noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _allreduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def child(launches: int) -> None:
    """In a fresh process, with one tree first on the path: the launch times, as JSON."""
    import nbddp
    from nbddp.local import forkserver
    from nbddp.rules import referee
    from nbddp.wire.messages import Ended, Received, Result

    results: dict[int, float] = {}
    exits: list[float] = []
    original = referee.Referee.event

    def event(self: referee.Referee, event: object) -> None:
        if isinstance(event, Received) and isinstance(event.message, Result):
            results[event.rank] = time.perf_counter()
        elif isinstance(event, Ended) and event.rank in results:
            exits.append(time.perf_counter() - results.pop(event.rank))
        original(self, event)

    referee.Referee.event = event  # type: ignore[method-assign]
    forkserver.prestart()
    time.sleep(3.0)  # the helper is up, as it is a cell after `import nbddp`

    def launch() -> None:
        nbddp.notebook_launch(_allreduce, num_workers=2, device="cpu", display="none")

    launch()
    times = []
    exits.clear()
    for _ in range(launches):
        time.sleep(0.3)
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    print(json.dumps({"file": nbddp.__file__, "times": times, "exits": exits}))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(other: str, rounds: int, launches: int) -> None:
    trees = {"this tree": HERE, "other tree": os.path.abspath(other)}
    times: dict[str, list[float]] = {name: [] for name in trees}
    exits: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(launches)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=trees[name],
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            assert result["file"].startswith(trees[name]), result["file"]
            times[name] += result["times"]
            exits[name] += result["exits"]
    print("| tree | what | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in trees:
        rows = (("whole launch", times[name]), ("a rank's result → exit", exits[name]))
        for what, values in rows:
            cells = [_percentile(values, q) * 1e3 for q in (0.5, 0.9, 0.99)] + [max(values) * 1e3]
            row = " | ".join(f"{c:.1f}" for c in cells)
            print(f"| {name} | {what} | {len(values)} | {row} |")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        given = [int(a) for a in sys.argv[2:4]]
        rounds, launches = [*given, *(6, 25)[len(given) :]]
        main(sys.argv[1], rounds, launches)
