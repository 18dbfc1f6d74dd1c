"""The rules that decide one task of a session from what its ranks report.

Like a launch's :class:`~nbddp.rules.referee.Referee` (both stand on
:class:`~nbddp.rules.judging.Judging`), but the ranks stay up after a task, so the task is over
when every rank answered, and what matters after a failure is whether every rank comes back to
idle with its process groups in step (the session keeps its state), or some are stuck, or came
back out of step (``rules/in_step.py``): then it must be replaced.

A graceful stop (:mod:`nbddp.rules.graceful`, as a launch's) lets a task that checks
``nbddp.stopping()`` end at one agreed step: every rank returns, the session keeps its state,
and the task is "stopped" with rank 0's value. When it cannot be graceful, the ranks are
interrupted at once, as by a plain stop.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from nbddp.backend import Outcome, RunEvents, Writable
from nbddp.errors import LaunchTimeout, WorkerError
from nbddp.recovery import STOP_GRACE
from nbddp.rules.graceful import GracefulStop
from nbddp.rules.in_step import out_of_step
from nbddp.rules.judging import SETTLE, Clock, Judging, write_out
from nbddp.rules.tracker import interrupted_note
from nbddp.state.terminal import CellStream
from nbddp.wire.messages import Failed, GroupCount, Issued, Result, Unsendable

if TYPE_CHECKING:
    from nbddp.plan import LaunchPlan

# How long ranks get to come back to idle after a failure, a stop or an interrupt before
# they count as stuck (e.g. in a collective waiting for a peer that failed) and are restarted.
GRACE = 5.0

Ending = Literal["failed", "stopped", "timeout"]


class TaskVerdict(NamedTuple):
    outcome: Outcome
    stuck: tuple[int, ...]  # ranks that never answered: the session's ranks must be replaced
    died: tuple[int, ...]  # ranks whose process ended
    # after a task cut short, every rank idle but their collectives out of step: what differs
    out_of_step: str | None = None

    @property
    def lost(self) -> bool:
        """The ranks cannot be kept: the session must replace them (their state is lost)."""
        return bool(self.stuck or self.died or self.out_of_step)


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
        issued: dict[int, tuple[GroupCount, ...] | None] | None = None,
        tell: Callable[[Any], None] = lambda message: None,
        stop_grace: float = STOP_GRACE,
    ) -> None:
        super().__init__(world_size, return_all, timeout, events, node_of, clock, tell)
        self.output: Writable = events.output or CellStream(sys.stdout)  # taken in the cell
        self.graceful = GracefulStop(world_size, tell, events, clock, stop_grace)
        self._at_once: str | None = None  # why a graceful stop had to interrupt instead
        self._interrupt = interrupt
        self._answered: set[int] = set()
        # each rank's last report of its collectives (kept across tasks: sent when changed)
        self._issued = issued if issued is not None else {}
        self._died: set[int] = set()
        self._ending: Ending | None = None
        self._grace_until: float | None = None
        self._held: float | None = None  # a failure's grace, held while a rank is in pdb

    @classmethod
    def for_plan(
        cls,
        plan: LaunchPlan,
        events: RunEvents,
        interrupt: Callable[[], None],
        node_of: Callable[[int], str | None] = lambda rank: None,
        issued: dict[int, tuple[GroupCount, ...] | None] | None = None,
        tell: Callable[[Any], None] = lambda message: None,
    ) -> TaskReferee:
        """The referee of one task run with ``plan``'s options (``interrupt``: interrupt the
        task on every rank; ``issued``: each rank's last report of its collectives; ``tell``:
        send to every rank)."""
        return cls(
            plan.world_size,
            plan.return_all,
            plan.timeout,
            events,
            interrupt,
            node_of=node_of,
            issued=issued,
            tell=tell,
            stop_grace=plan.stop_grace,
        )

    def stop_gracefully(self, why: str) -> None:
        """Ask for a graceful stop from any thread; the caller wakes the loop, which sends
        it."""
        self.graceful.request(why)

    def _message(self, rank: int, message: Any, buffers: list[Any]) -> None:
        if self.graceful.heard(rank, message):
            return
        match message:
            case Issued(groups=groups):
                self._issued[rank] = groups
            case Result(stream=stream):
                self.tracker.result(rank, stream, buffers, False)
                self._answered.add(rank)
                self.graceful.returned(rank)
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
        self.graceful.gone(rank)
        self._end("failed", SETTLE)

    def _printed(self, text: str) -> None:
        write_out(self.output, text)

    def _end(self, why: Ending, grace: float | None = None) -> None:
        """The task ends early: interrupt who still runs it, and give them ``grace``
        (``GRACE``, read now: a test may shorten it)."""
        grace = GRACE if grace is None else grace
        if why == "failed" and self.in_pdb and self._ending is None:
            self._held = grace if self._held is None else min(grace, self._held)
            return  # a person debugs a rank: the task fails once they leave pdb
        now = self._clock()
        if self._ending is None:
            self._ending = why
            self._interrupt()
        if self._grace_until is None or now + grace < self._grace_until:
            self._grace_until = now + grace

    def deadline(self) -> float | None:
        if self._ending is not None:
            return self._grace_until
        if self.graceful.why is not None and self._timed_out():  # the grace bounds it now
            return self.graceful.deadline()
        return self._earliest(self.graceful.deadline())

    def verdict(self) -> TaskVerdict | None:
        if self._held is not None and not self.in_pdb:
            grace, self._held = self._held, None
            self._end("failed", grace)
        everyone = len(self._answered) == self.world_size
        if self._ending is None and not everyone:
            self._stopping()
        if self._ending is None:
            return TaskVerdict(self._collect(), (), ()) if everyone else None
        assert self._grace_until is not None
        if not everyone and self._clock() < self._grace_until:
            return None
        stuck = tuple(r for r in range(self.world_size) if r not in self._answered)
        died = tuple(sorted(self._died))
        # cut short: an interrupt may have come between a collective's start and its wait
        differs = None if stuck or died else out_of_step(self._issued, self.world_size)
        return TaskVerdict(self._outcome(differs), stuck, died, differs)

    def _stopping(self) -> None:
        """A stop, a graceful stop that cannot be, or the timeout (which asks for a graceful
        stop first) ends the task early; a graceful stop under way waits for its step."""
        self.graceful.send(set(range(self.world_size)), self._died, self._answered)
        at_once = self.graceful.at_once()
        if self.stop_requested:
            self._end("stopped")
        elif at_once is not None:
            self._at_once = at_once
            self._end("timeout" if self._timed_out() else "stopped")
        elif self._timed_out() and self.graceful.why is None:
            assert self._timeout is not None
            self.graceful.request(f"the timeout of {self._timeout:g} s")
            self._stopping()

    def _collect(self) -> Outcome:
        """Every rank answered: the task's outcome ("stopped" with rank 0's value when a
        graceful stop landed)."""
        outcome = self.tracker.collect()
        if outcome.status == "succeeded" and self.graceful.landed is not None:
            return outcome._replace(status="stopped", graceful=self.graceful.sentence())
        return outcome

    def _outcome(self, differs: str | None) -> Outcome:
        if self._ending == "stopped":
            if self._at_once is None:
                return Outcome("stopped")
            return Outcome("stopped", warning=f"it was stopped at once: {self._at_once}.")
        if self._ending == "timeout":
            assert self._timeout is not None
            ended = self._interrupted(differs)
            if self._at_once is not None:  # why the timeout's graceful stop could not be
                ended += f" (not gracefully: {self._at_once})"
            return Outcome("failed", error=LaunchTimeout(self._timeout, ended))
        root = self.tracker.root_cause()
        note = interrupted_note(self.tracker.failures, root)
        if note and isinstance(root.error, WorkerError):  # the ranks stay: say what they lack
            root.error.hint = f"{root.error.hint}\n{note}" if root.error.hint else note
        return Outcome("failed", error=root.error)

    def _interrupted(self, differs: str | None) -> str:
        """What the timeout's interrupt left: the ranks' state kept, or fresh ranks."""
        if differs is not None:
            return (
                "the session's ranks were interrupted, but their collectives were left out of "
                f"step ({differs}), so fresh ones were started: the state on the ranks is lost"
            )
        if len(self._answered) == self.world_size:
            return "the session's ranks were interrupted and kept their state"
        return (
            f"the session's ranks did not return within {GRACE:g} s of the interrupt, so fresh "
            "ones were started: the state on the ranks is lost"
        )


def trigger(outcome: Outcome) -> str:
    """What cut a task short, for the user: "the stop", "the timeout" or "the failure"."""
    if outcome.status == "stopped":
        return "the stop"
    return "the timeout" if isinstance(outcome.error, LaunchTimeout) else "the failure"


def restart_cause(verdict: TaskVerdict, what: str) -> str:
    """Why the session's ranks could not be kept after a task (``verdict.lost``)."""
    if verdict.died:
        who = ", ".join(map(str, verdict.died))
        return f"rank {who} died, which breaks the process group"
    if verdict.stuck:
        who = ", ".join(map(str, verdict.stuck))
        return (
            f"rank {who} did not return to idle within {GRACE:g} s of {what} (stuck, e.g. in a "
            "collective waiting for a rank that failed)"
        )
    return (
        f"after {what}, the ranks' collectives were out of step ({verdict.out_of_step}; an "
        "interrupt landed inside a collective, and the next one would hang or pair with the "
        "stale one)"
    )


def restart_note(verdict: TaskVerdict, what: str) -> str:
    return (
        f"The session was restarted: {restart_cause(verdict, what)}, so its ranks were ended "
        "and fresh ones started. State on the ranks is lost: rerun the cells that built it."
    )
