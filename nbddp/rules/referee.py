"""The rules that decide a run from what its ranks report, wherever the ranks run.

A :class:`Referee` hears every rank event (a message, an end), passes the live ones on to the
run's state, tells the ranks when all of them joined the process group, and gives the verdict:

* the first failure ends the run; the root cause is chosen (:mod:`nbddp.rules.tracker`) among the
  failures that arrive within ``SETTLE`` seconds, or once every rank is accounted for;
* a stop request ends it as "stopped";
* the ``timeout`` ends it with :class:`~nbddp.errors.LaunchTimeout`;
* when every rank exited after reporting, rank 0's value (or every rank's) is the result.

The same referee judges ranks on this machine (fed by a ``RankGroup`` on the loop's thread)
and on a cluster (fed by what the nodes forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbddp.backend import Outcome, RunEvents
from nbddp.errors import LaunchTimeout
from nbddp.rules.tracker import RunTracker
from nbddp.wire.messages import (
    AllJoined,
    Bars,
    DeviceName,
    Ended,
    Failed,
    Joined,
    MainRows,
    Printed,
    RankEvent,
    Received,
    Result,
    Rows,
    Started,
    Unsendable,
)

# After the first failure, how long to wait for the other ranks' news before choosing the root
# cause: a rank that dies closes its sockets before it can be seen to exit, so a peer's
# "Connection closed by peer" report can reach the kernel before the death that caused it.
SETTLE = 0.5


def forward_live(events: RunEvents, rank: int, message: Any) -> bool:
    """Pass what the live view shows (metrics rows, bars, the device) straight on to the run;
    False when ``message`` is none of those, and the judge decides what it means."""
    match message:
        case Rows(first=first, blocks=blocks):
            events.rows(rank, first, blocks)
        case MainRows(rows=rows):
            if rank == 0:  # rank-0-only reports (Accelerate's trackers)
                events.main_rows(rows)
        case Bars(bars=bars):
            events.bars(bars)
        case DeviceName(name=name):
            events.device(name)
        case _:
            return False
    return True


class Referee:
    """Judges one run. ``broadcast`` sends a message to every rank; ``started_groups`` is how
    many groups (machines) must report ``Started`` before the run is "running"; ``node_of``
    names a rank's machine in errors (None on one machine)."""

    def __init__(
        self,
        world_size: int,
        return_all: bool,
        timeout: float | None,
        events: RunEvents,
        broadcast: Callable[[Any], None],
        started_groups: int = 1,
        node_of: Callable[[int], str | None] = lambda rank: None,
    ) -> None:
        self.world_size = world_size
        self.tracker = RunTracker(world_size, return_all)
        self._events = events
        self._broadcast = broadcast
        self._node_of = node_of
        self._groups_to_start = started_groups
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout if timeout else None
        self._settled: float | None = None
        self._joined: set[int] = set()
        self.stop_requested = False

    def stop(self) -> None:
        self.stop_requested = True

    def event(self, event: RankEvent) -> None:
        events, tracker = self._events, self.tracker
        match event:
            case Received(rank=rank, message=message, buffers=buffers):
                if forward_live(events, rank, message):
                    return
                match message:
                    case Joined():
                        self._joined.add(rank)
                        if len(self._joined) == self.world_size:
                            self._broadcast(AllJoined())
                    case Result(stream=stream, early_exit=early):
                        tracker.result(rank, stream, buffers, early)
                    case Failed(report=report):
                        tracker.raised(rank, report, self._node_of(rank))
                    case Unsendable(path=path, reason=reason):
                        tracker.unsendable(rank, path, reason)
            case Ended(rank=rank, code=code, stderr_tail=tail):
                tracker.ended(rank, code, tail, self._node_of(rank))
            case Started():
                self._groups_to_start -= 1
                if self._groups_to_start == 0:
                    events.started()
            case Printed(text=text):
                self._print(text)

    def _print(self, text: str) -> None:
        import sys

        target = self._events.output or sys.stdout
        try:
            target.write(text)
            target.flush()
        except (OSError, ValueError):
            pass

    def deadline(self) -> float | None:
        times = [t for t in (self._deadline, self._settled) if t is not None]
        return min(times) if times else None

    def verdict(self) -> Outcome | None:
        tracker = self.tracker
        if tracker.failures:
            self._settled = self._settled or time.monotonic() + SETTLE
            if tracker.everyone_accounted_for or time.monotonic() >= self._settled:
                return Outcome("failed", error=tracker.root_cause().error)
            return None  # a failure is decided: only the choice of root cause is left
        if self.stop_requested:
            return Outcome("stopped")
        if len(tracker.exited) == self.world_size:
            return tracker.collect()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            assert self._timeout is not None
            return Outcome("failed", error=LaunchTimeout(self._timeout))
        return None
