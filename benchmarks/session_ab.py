"""An empty session task on two nbddp trees, interleaved: is a change free for a session?

    python benchmarks/session_ab.py OTHER_TREE [ROUNDS] [TASKS]

Compares this tree with ``OTHER_TREE`` (e.g. a ``git worktree`` of the commit before a change)
on ``session.run(empty)`` on 2 CPU ranks already up, no kernel (as ``session.py --tasks``):
what every session task costs before any user code (the wire, the ranks' bookkeeping, the
judging). Each round starts one fresh process per tree (alternating which goes first), which
starts a session, runs 20 tasks untimed, then times ``TASKS`` tasks back to back; then the
session starting (``nbddp.Session(...)``, warm helper) and closing are timed once per round.
Prints each tree's p50/p90/p99/max over all rounds: the rounds interleave the trees, so the
load they see is the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def empty() -> None:
    pass


def child(tasks: int) -> None:
    """In a fresh process, with one tree first on the path: the times, as JSON."""
    import nbddp
    from nbddp.local import forkserver

    forkserver.prestart()
    forkserver.wait_until_ready(60)
    times = []
    started = time.perf_counter()
    session = nbddp.Session(num_workers=2, device="cpu")
    start = time.perf_counter() - started
    try:
        for _ in range(20):  # warm up
            session.run(empty, display="none")
        for _ in range(tasks):
            began = time.perf_counter()
            session.run(empty, display="none")
            times.append(time.perf_counter() - began)
    finally:
        began = time.perf_counter()
        session.close()
        close = time.perf_counter() - began
    print(json.dumps({"file": nbddp.__file__, "times": times, "start": start, "close": close}))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(other: str, rounds: int, tasks: int) -> None:
    trees = {"this tree": HERE, "other tree": os.path.abspath(other)}
    found: dict[str, dict[str, list[float]]] = {
        name: {"task": [], "start": [], "close": []} for name in trees
    }
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(tasks)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=trees[name],
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            assert result["file"].startswith(trees[name]), result["file"]
            found[name]["task"] += result["times"]
            found[name]["start"].append(result["start"])
            found[name]["close"].append(result["close"])
    print("| tree | what | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    labels = {"task": "empty task", "start": "session start", "close": "session close"}
    for name in trees:
        for what, values in found[name].items():
            cells = [_percentile(values, q) * 1e3 for q in (0.5, 0.9, 0.99)] + [max(values) * 1e3]
            row = " | ".join(f"{c:.2f}" for c in cells)
            print(f"| {name} | {labels[what]} | {len(values)} | {row} |")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        given = [int(a) for a in sys.argv[2:4]]
        rounds, tasks = [*given, *(6, 200)[len(given) :]]
        main(sys.argv[1], rounds, tasks)
