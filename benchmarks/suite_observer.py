"""A pytest plugin for ``benchmarks/suite_time.py``: each test's worker, start, end and CPU,
written as one JSON line per test to ``$NBDDP_SUITE_TIMELINE/<worker>.jsonl``. It only watches.

A test's CPU is what its worker's process tree spent meanwhile: the worker itself, the children
it reaped, and each live descendant's own time and that of the children it reaped (a rank
reaped by the warm helper counts in the helper's). Tests overlap on the machine, so this, not
the machine's busy share, says what each one costs. A daemon that left the tree (Slurm's step
daemons, reparented to init) is not seen."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import psutil
import pytest


def tree_cpu() -> dict[int, float]:
    """CPU seconds of this process (with its reaped children) and each live descendant."""
    own = os.times()
    seen = {0: own.user + own.system + own.children_user + own.children_system}
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
            seen[proc.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return seen


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two looks: a process seen only before has been reaped, and its
    time is now in its reaper's (seen after), so it is not counted on its own."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    started, cpu_before = time.time(), tree_cpu()
    try:
        return (yield)
    finally:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        record = {
            "id": item.nodeid,
            "worker": worker,
            "start": started,
            "end": time.time(),
            "cpu": round(spent(cpu_before, tree_cpu()), 3),
        }
        path = os.path.join(os.environ["NBDDP_SUITE_TIMELINE"], f"{worker}.jsonl")
        with open(path, "a") as timeline:
            timeline.write(json.dumps(record) + "\n")
