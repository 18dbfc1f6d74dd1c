"""The rules that decide one task of a session from what its ranks report.

Like a launch's :class:`~nbddp.rules.referee.Referee` (both stand on
:class:`~nbddp.rules.judging.Judging`), but the ranks stay up after a task, so the task is over
when every rank answered, and what matters after a failure is whether every rank comes back to
idle (the session keeps its state) or some are stuck (it must be replaced).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from nbddp.backend import Outcome, RunEvents, Writable
from nbddp.display.terminal import CellStream
from nbddp.errors import LaunchTimeout
from nbddp.rules.judging import SETTLE, Clock, Judging, write_out
from nbddp.wire.messages import Failed, Result, Unsendable

# How long ranks get to come back to idle after a failure, a stop or an interrupt before
# they count as stuck (e.g. in a collective waiting for a peer that failed) and are restarted.
GRACE = 5.0

Ending = Literal["failed", "stopped", "timeout"]


class TaskVerdict(NamedTuple):
    outcome: Outcome
    stuck: tuple[int, ...]  # ranks that never answered: the session's ranks must be replaced
    died: tuple[int, ...]  # ranks whose process ended


class TaskReferee(Judging):
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
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(world_size, return_all, timeout, events, node_of, clock)
        self.output: Writable = events.output or CellStream(sys.stdout)  # taken in the cell
        self._interrupt = interrupt
        self._answered: set[int] = set()
        self._died: set[int] = set()
        self._ending: Ending | None = None
        self._grace_until: float | None = None

    def _message(self, rank: int, message: Any, buffers: list[Any]) -> None:
        match message:
            case Result(stream=stream):
                self.tracker.result(rank, stream, buffers, False)
                self._answered.add(rank)
            case Failed(report=report):
                self.tracker.raised(rank, report, self._node_of(rank))
                self._answered.add(rank)
                self._end("failed")
            case Unsendable(path=path, reason=reason):
                self.tracker.unsendable(rank, path, reason)
                self._answered.add(rank)
                self._end("failed")

    def _ended(self, rank: int, code: int | None, stderr_tail: str) -> None:
        if rank not in self._answered:  # a rank must never end: it died in the task
            self.tracker.ended(rank, code, stderr_tail, self._node_of(rank))
        self._answered.add(rank)
        self._died.add(rank)
        self._end("failed", SETTLE)

    def _printed(self, text: str) -> None:
        write_out(self.output, text)

    def _end(self, why: Ending, grace: float = GRACE) -> None:
        """The task ends early: interrupt who still runs it, and give them ``grace``."""
        now = self._clock()
        if self._ending is None:
            self._ending = why
            self._interrupt()
        if self._grace_until is None or now + grace < self._grace_until:
            self._grace_until = now + grace

    def deadline(self) -> float | None:
        return self._earliest(self._grace_until)

    def verdict(self) -> TaskVerdict | None:
        if self._ending is None:
            if self.stop_requested:
                self._end("stopped")
            elif self._timed_out():
                self._end("timeout")
        everyone = len(self._answered) == self.world_size
        if self._ending is None:
            return TaskVerdict(self.tracker.collect(), (), ()) if everyone else None
        assert self._grace_until is not None
        if not everyone and self._clock() < self._grace_until:
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
