"""Where the milliseconds of a pre-warmed launch go (2 CPU ranks, a trivial all_reduce).

    python benchmarks/launch_phases.py [LAUNCHES]

Each phase's end is stamped by wrapping nbddp's own steps (a benchmark may look inside; the
package has no timing hooks of its own); the table gives the median over launches, spaced
0.3 s apart as cells are, after one launch that is not counted.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import nbddp
import nbddp.launch
from nbddp import launch
from nbddp.local import forkserver
from nbddp.local import group as rankgroup
from nbddp.rules import referee

PHASES = [
    ("planned and pickled", "plan, `dumps_call`, the backend chosen"),
    ("ranks asked for", "run dir, listener, `spec.json`, script; the helper hands out 2 ranks"),
    ("first hello", "a rank is up: new session, fresh seeds, script, connect, handshake"),
    ("every rank has its job", "the other rank's hello; the pickled call sent to each"),
    ("every result in", "unpickle the call, `init_process_group` (gloo), `fn`, the result"),
    ("every rank exited", "each rank ends what it started and exits"),
    ("the call returns", "teardown (reap, close, remove the directory), value unpickled"),
]


def _allreduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _stamp_after(owner: Any, name: str, marks: dict[str, float], label: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def stamped(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            marks.setdefault(label, time.perf_counter())

    setattr(owner, name, stamped)


def _instrument(marks: dict[str, float]) -> None:
    _stamp_after(launch, "_backend_for", marks, "planned and pickled")
    _stamp_after(rankgroup.RankGroup, "start", marks, "ranks asked for")
    _stamp_after(rankgroup.RankGroup, "_welcome", marks, "first hello")
    event = referee.Referee.event

    def heard(self: Any, what: Any) -> None:
        event(self, what)
        name = type(what).__name__
        if name == "Started":
            marks.setdefault("every rank has its job", time.perf_counter())
        elif name == "Received" and self.tracker.all_returned:
            marks.setdefault("every result in", time.perf_counter())
        elif name == "Ended" and len(self.tracker.exited) == self.world_size:
            marks.setdefault("every rank exited", time.perf_counter())

    referee.Referee.event = heard  # type: ignore[method-assign]


def run(launches: int = 20) -> str:
    forkserver.prestart()
    forkserver.wait_until_ready(60)
    time.sleep(1)
    marks: dict[str, float] = {}
    _instrument(marks)
    spans: dict[str, list[float]] = {label: [] for label, _ in PHASES}
    totals = []
    for index in range(launches + 1):
        time.sleep(0.3)
        marks.clear()
        started = time.perf_counter()
        nbddp.notebook_launch(_allreduce, num_workers=2, device="cpu", display="none")
        marks["the call returns"] = time.perf_counter()
        if index == 0:
            continue
        totals.append(marks["the call returns"] - started)
        previous = started
        for label, _ in PHASES:
            spans[label].append(marks[label] - previous)
            previous = marks[label]
    rows = ["| phase (ends when) | what happens | median ms |", "| --- | --- | ---: |"]
    for label, what in PHASES:
        rows.append(f"| {label} | {what} | {1000 * statistics.median(spans[label]):.1f} |")
    rows.append(f"| **whole launch** | | **{1000 * statistics.median(totals):.1f}** |")
    rows.append("")
    rows.append(f"Medians of {launches} launches, 0.3 s apart, one pre-warmed helper.")
    return "\n".join(rows)


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
