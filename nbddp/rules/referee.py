"""The rules that decide a launch from what its ranks report, wherever the ranks run.

A :class:`Referee` hears every rank event (a message, an end), tells the ranks when all of
them joined the process group, and gives the verdict:

* the first failure ends the run; the root cause is chosen (:mod:`nbddp.rules.tracker`) among
  the failures that arrive within ``SETTLE`` seconds, or once every rank is accounted for;
* a stop request ends it as "stopped";
* the ``timeout`` ends it with :class:`~nbddp.errors.LaunchTimeout`;
* when every rank exited after reporting, rank 0's value (or every rank's) is the result.

The same referee judges ranks on this machine (fed by a ``RankGroup`` on the loop's thread)
and on a cluster (fed by what the nodes forward). What it shares with a session task's judge
is in :mod:`nbddp.rules.judging`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbddp.backend import Outcome, RunEvents
from nbddp.errors import LaunchTimeout
from nbddp.rules.judging import SETTLE, Clock, Judging
from nbddp.wire.messages import AllJoined, Failed, Joined, Result, Trained, Unsendable


class Referee(Judging):
    """Judges one launch: it is over when every rank exited, or at the first failure.
    ``broadcast`` sends a message to every rank; ``started_groups`` is how many groups
    (machines) must report ``Started`` before the run is "running"."""

    def __init__(
        self,
        world_size: int,
        return_all: bool,
        timeout: float | None,
        events: RunEvents,
        broadcast: Callable[[Any], None],
        started_groups: int = 1,
        node_of: Callable[[int], str | None] = lambda rank: None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(world_size, return_all, timeout, events, node_of, clock)
        self._broadcast = broadcast
        self._groups_to_start = started_groups
        self._settled: float | None = None
        self._joined: set[int] = set()

    def _message(self, rank: int, message: Any, buffers: list[Any]) -> None:
        match message:
            case Joined():
                self._joined.add(rank)
                if len(self._joined) == self.world_size:
                    self._broadcast(AllJoined())
            case Trained(check=check):
                self.tracker.trained(rank, check)
            case Result(stream=stream, early_exit=early):
                self.tracker.result(rank, stream, buffers, early)
            case Failed(report=report):
                self.tracker.raised(rank, report, self._node_of(rank))
            case Unsendable(path=path, reason=reason):
                self.tracker.unsendable(rank, path, reason)

    def _ended(self, rank: int, code: int | None, stderr_tail: str) -> None:
        self.tracker.ended(rank, code, stderr_tail, self._node_of(rank))

    def _started(self) -> None:
        self._groups_to_start -= 1
        if self._groups_to_start == 0:
            self._events.started()

    def deadline(self) -> float | None:
        return self._earliest(self._settled)

    def verdict(self) -> Outcome | None:
        tracker = self.tracker
        if tracker.failures:
            self._settled = self._settled or self._clock() + SETTLE
            if tracker.everyone_accounted_for or self._clock() >= self._settled:
                return Outcome("failed", error=tracker.root_cause().error)
            return None  # a failure is decided: only the choice of root cause is left
        if self.stop_requested:
            return Outcome("stopped")
        if len(tracker.exited) == self.world_size:
            return tracker.collect()
        if self._timed_out():
            assert self._timeout is not None
            return Outcome("failed", error=LaunchTimeout(self._timeout))
        return None
