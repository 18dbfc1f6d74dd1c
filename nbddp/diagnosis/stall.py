"""The stall banner: when no rank made progress for ``stall_after`` seconds, the panel says
where each rank is. Nothing is killed.

Progress is what the run's state sees (logged rows, bars, output) and CPU time: after half of
``stall_after`` without the first, a roll-call notes each rank's CPU time; at ``stall_after``
another one compares. A rank that used more than ``BUSY`` of a core in between is working (a
long step that logs nothing), so the wait starts again. The watch costs nothing while the run
makes progress: it only reads a timestamp.

Except a rank that waits on its GPU for a collective: the CUDA runtime spins a core while a
process waits in ``synchronize()`` or ``.item()`` (and NCCL's proxy thread polls), so an NCCL
rank stuck in a collective looks as busy as one that trains. A rank whose newest collective is
the same in both roll-calls, and which its backend says has not completed (NCCL's flight
recorder does; gloo's does not, and a gloo rank waiting in a collective uses no CPU), is not
working, whatever its CPU time.

Non-goal: how the banner looks (``display/``), or asking the ranks (``Run.stacks``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nbddp.diagnosis.stacks import Stacks
from nbddp.wire.stacks import StackReport

BUSY = 0.2  # share of one core a rank must use to count as working


class StallWatch:
    """Watches one run from a daemon thread until :meth:`close`."""

    def __init__(
        self,
        stall_after: float,
        last_progress: Callable[[], float],
        take: Callable[[float], Stacks],
        show: Callable[[Stacks | None, float], None],
    ) -> None:
        self._after = stall_after
        self._last_progress = last_progress
        self._take = take
        self._show = show
        self._closed = threading.Event()
        self.stalled: Stacks | None = None  # the roll-call the banner shows, while it shows
        self._thread = threading.Thread(target=self._loop, name="nbddp-stall", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        tick = min(max(self._after / 8, 0.1), 5.0)
        quiet_since = self._last_progress()
        baseline: tuple[float, Stacks] | None = None
        while not self._closed.wait(tick):
            progress = self._last_progress()
            if progress > quiet_since:  # something moved: start over, drop the banner
                quiet_since, baseline = progress, None
                if self.stalled is not None:
                    self.stalled = None
                    self._show(None, 0.0)
                continue
            if self.stalled is not None:
                continue
            quiet = time.monotonic() - quiet_since
            if baseline is None and quiet >= self._after / 2:
                baseline = (time.monotonic(), self._take(min(tick * 4, 3.0)))
            elif baseline is not None and quiet >= self._after:
                now = time.monotonic()
                stacks = self._take(min(tick * 4, 3.0))
                if self._closed.is_set():
                    return
                if _working(baseline[1], stacks, now - baseline[0]):
                    quiet_since, baseline = now, None  # a long step that logs nothing
                    continue
                self.stalled = stacks
                self._show(stacks, quiet)


def _working(before: Stacks, after: Stacks, seconds: float) -> bool:
    """Some rank used more than ``BUSY`` of a core between the two roll-calls, or cannot be
    judged: a rank that did not answer is still starting (importing, connecting)."""
    for rank in range(after.world_size):
        a, b = before[rank], after[rank]
        if a is None or b is None:
            return True
        if a.cpu_time is None or b.cpu_time is None or _waits_on_a_collective(a, b):
            continue
        if b.cpu_time - a.cpu_time > BUSY * seconds:
            return True
    return False


def _waits_on_a_collective(before: StackReport, after: StackReport) -> bool:
    """The rank's newest collective is the one it had at the last roll-call, still not
    completed: its CPU time is a spinning wait, not work."""
    if not before.collectives or not after.collectives:
        return False
    newest = after.collectives[-1]
    return newest.completed is False and newest == before.collectives[-1]
