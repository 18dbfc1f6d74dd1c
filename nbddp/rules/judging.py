"""What every judge of ranks shares: the run's tracker, the live view's messages, stop and
timeout, and a clock. A judge is a policy on top: a launch's :class:`~nbddp.rules.referee.Referee`
(the run ends when ranks exit) and a session task's
:class:`~nbddp.rules.task_referee.TaskReferee` (the task ends when every rank answered) differ
only in what a rank's message or end means and in their verdict, as Ray Train's failure policy
sits apart from its worker group's poll.

Non-goal: sockets, processes, threads. Judges are fed events on one thread and asked for a
verdict; the clock is a parameter, so the timing rules are tested without waiting.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from nbddp.backend import RunEvents, Writable
from nbddp.rules.tracker import RunTracker
from nbddp.wire.messages import (
    Bars,
    DeviceName,
    Display,
    Ended,
    MainRows,
    NodeLost,
    Printed,
    RankEvent,
    Received,
    Rows,
    Started,
)
from nbddp.wire.prompts import LeftPdb, Prompt, Quit, Reply
from nbddp.wire.stacks import RankStacks

# After the first failure, how long to wait for the other ranks' news before choosing the root
# cause: a rank that dies closes its sockets before it can be seen to exit, so a peer's
# "Connection closed by peer" report can reach the kernel before the death that caused it.
SETTLE = 0.5

Clock = Callable[[], float]

COLLATERAL = "another rank failed first: its error is the run's, and only it is debugged"


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
        case Display():
            events.display(message)
        case RankStacks(query=query, report=report):
            events.stacks(rank, query, report)
        case _:
            return False
    return True


def write_out(target: Writable | None, text: str) -> None:
    """Show ``text`` in the notebook (``target``, else the current ``sys.stdout``); a stream
    that closed meanwhile (the cell ended, the kernel shuts down) loses it quietly."""
    stream = target or sys.stdout
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass


class Judging:
    """The part of a judge that is the same for a launch and a session task. Subclasses say
    what a rank's message (:meth:`_message`) and a rank's end (:meth:`_ended`) mean, and give
    the ``verdict``; ``node_of`` names a rank's machine in errors (None on one machine)."""

    def __init__(
        self,
        world_size: int,
        return_all: bool,
        timeout: float | None,
        events: RunEvents,
        node_of: Callable[[int], str | None] = lambda rank: None,
        clock: Clock = time.monotonic,
        tell: Callable[[Any], None] = lambda message: None,
    ) -> None:
        self.world_size = world_size
        self.tracker = RunTracker(world_size, return_all)
        self._tell = tell  # to every rank
        self._events = events
        self._node_of = node_of
        self._clock = clock
        self._timeout = timeout
        self._deadline = clock() + timeout if timeout else None
        self.stop_requested = False
        self.in_pdb: set[int] = set()  # a person debugs them: a failure waits for them

    def stop(self) -> None:
        self.stop_requested = True

    def expire_at(self, deadline: float) -> None:
        """The timeout ends at ``deadline`` on this judge's clock (a restarted world's
        timeout is what is left of the run's)."""
        self._deadline = deadline

    def event(self, event: RankEvent) -> None:
        match event:
            case Received(rank=rank, message=Prompt() | LeftPdb() | Quit() as message):
                self._debugging(rank, message)
            case Received(rank=rank, message=message, buffers=buffers):
                if not forward_live(self._events, rank, message):
                    self._message(rank, message, buffers)
            case Ended(rank=rank, code=code, stderr_tail=tail):
                self._left_pdb(rank)
                self._ended(rank, code, tail)
            case NodeLost(ranks=ranks, node=node, reason=reason):
                self.tracker.node_lost(ranks, node, reason)
                for rank in ranks:
                    self._left_pdb(rank)
                    self._ended(rank, None, "")
            case Started():
                self._started()
            case Printed(text=text):
                self._printed(text)

    def _debugging(self, rank: int, message: Prompt | LeftPdb | Quit) -> None:
        """A rank's pdb: it waits for a line (the run's state asks the person), it left, or
        ``q`` ended the run as stopped."""
        match message:
            case Prompt(kind="post-mortem", seq=seq) if self.tracker.failures:
                # a rank already failed: this error follows from it; only the first is debugged
                self._tell(Reply(rank, seq, None, COLLATERAL))
            case Prompt(kind=kind):
                if kind != "input":
                    self.in_pdb.add(rank)
                self._events.prompt(rank, message)
            case LeftPdb():
                self.in_pdb.discard(rank)
                self._events.left_pdb(rank, message)
            case Quit():
                self.stop()

    def _left_pdb(self, rank: int) -> None:
        """A rank that ended asks nothing any more."""
        self.in_pdb.discard(rank)
        self._events.left_pdb(rank, None)

    def _message(self, rank: int, message: Any, buffers: list[Any]) -> None:
        raise NotImplementedError

    def _ended(self, rank: int, code: int | None, stderr_tail: str) -> None:
        raise NotImplementedError

    def _started(self) -> None:
        """Every rank of a group has its job; only a launch's state cares."""

    def _printed(self, text: str) -> None:
        write_out(self._events.output, text)

    def _timed_out(self) -> bool:
        return self._deadline is not None and self._clock() >= self._deadline

    def _earliest(self, *times: float | None) -> float | None:
        """The next instant the verdict may change by itself: the timeout or ``times``."""
        known = [t for t in (self._deadline, *times) if t is not None]
        return min(known) if known else None
