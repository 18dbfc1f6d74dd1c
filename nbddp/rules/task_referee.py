"""The rules that decide one task of a session from what its ranks report.

Like a launch's :class:`~nbddp.rules.referee.Referee`, but the ranks stay up after a task, so the
task is over when every rank answered, and what matters after a failure is whether every
rank comes back to idle (the session keeps its state) or some are stuck (it must be replaced).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from nbddp.backend import Outcome, RunEvents, Writable
from nbddp.display.terminal import CellStream
from nbddp.errors import LaunchTimeout
from nbddp.rules.referee import SETTLE, forward_live
from nbddp.rules.tracker import RunTracker
from nbddp.wire.messages import Ended, Failed, RankEvent, Received, Result, Unsendable

# How long ranks get to come back to idle after a failure, a stop or an interrupt before
# they count as stuck (e.g. in a collective waiting for a peer that failed) and are restarted.
GRACE = 5.0


class TaskVerdict(NamedTuple):
    outcome: Outcome
    stuck: tuple[int, ...]  # ranks that never answered: the session's ranks must be replaced
    died: tuple[int, ...]  # ranks whose process ended


class TaskReferee:
    """Judges one task. The ranks stay up, so the task is over when every rank answered. A
    failure, a stop or the timeout interrupts the ranks still running it; those that do not
    answer within ``GRACE`` are stuck. A rank that dies leaves the process group broken, so
    the others get only ``SETTLE`` to report what they saw."""

    def __init__(
        self,
        world_size: int,
        return_all: bool,
        timeout: float | None,
        events: RunEvents,
        interrupt: Callable[[], None],
        node_of: Callable[[int], str | None] = lambda rank: None,
    ) -> None:
        self.world_size = world_size
        self._node_of = node_of
        self.tracker = RunTracker(world_size, return_all)
        self._events = events
        self.output: Writable = events.output or CellStream(sys.stdout)  # taken in the cell
        self._interrupt = interrupt
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout if timeout else None
        self._answered: set[int] = set()
        self._died: set[int] = set()
        self._ending: str | None = None  # "failed", "stopped" or "timeout"
        self._grace_until: float | None = None
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
                    case Result(stream=stream):
                        tracker.result(rank, stream, buffers, False)
                        self._answered.add(rank)
                    case Failed(report=report):
                        tracker.raised(rank, report, self._node_of(rank))
                        self._answered.add(rank)
                        self._end("failed")
                    case Unsendable(path=path, reason=reason):
                        tracker.unsendable(rank, path, reason)
                        self._answered.add(rank)
                        self._end("failed")
            case Ended(rank=rank, code=code, stderr_tail=tail):
                if rank not in self._answered:  # a rank must never end: it died in the task
                    tracker.ended(rank, code, tail, self._node_of(rank))
                self._answered.add(rank)
                self._died.add(rank)
                self._end("failed", SETTLE)

    def _end(self, why: str, grace: float = GRACE) -> None:
        """The task ends early: interrupt who still runs it, and give them ``grace``."""
        now = time.monotonic()
        if self._ending is None:
            self._ending = why
            self._interrupt()
        if self._grace_until is None or now + grace < self._grace_until:
            self._grace_until = now + grace

    def deadline(self) -> float | None:
        times = [t for t in (self._deadline, self._grace_until) if t is not None]
        return min(times) if times else None

    def verdict(self) -> TaskVerdict | None:
        now = time.monotonic()
        if self._ending is None:
            if self.stop_requested:
                self._end("stopped")
            elif self._deadline is not None and now >= self._deadline:
                self._end("timeout")
        everyone = len(self._answered) == self.world_size
        if self._ending is None:
            return TaskVerdict(self.tracker.collect(), (), ()) if everyone else None
        assert self._grace_until is not None
        if not everyone and now < self._grace_until:
            return None
        stuck = tuple(r for r in range(self.world_size) if r not in self._answered)
        return TaskVerdict(self._outcome(), stuck, tuple(sorted(self._died)))

    def _outcome(self) -> Outcome:
        if self._ending == "stopped":
            return Outcome("stopped")
        if self._ending == "timeout":
            assert self._timeout is not None
            if len(self._answered) == self.world_size:
                ended = "the session's ranks were interrupted and kept their state"
            else:
                ended = (
                    f"the session's ranks did not return within {GRACE:g} s of the interrupt, "
                    "so fresh ones were started: the state on the ranks is lost"
                )
            return Outcome("failed", error=LaunchTimeout(self._timeout, ended))
        return Outcome("failed", error=self.tracker.root_cause().error)
