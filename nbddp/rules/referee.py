"""The rules that decide a launch from what its ranks report, wherever the ranks run.

A :class:`Referee` hears every rank event (a message, an end), tells the ranks when all of
them joined the process group, and gives the verdict:

* the first failure ends the run; the root cause is chosen (:mod:`nbddp.rules.tracker`) among
  the failures that arrive within ``SETTLE`` seconds, or once every rank is accounted for;
* a stop request ends it as "stopped";
* a graceful stop (:mod:`nbddp.rules.graceful`) lets the ranks end at one agreed step: the
  run is then "stopped" with rank 0's value; when it cannot be graceful, it ends at once;
* the ``timeout`` asks for a graceful stop, and ends the run with
  :class:`~nbddp.errors.LaunchTimeout` when it cannot be graceful;
* when every rank exited after reporting, rank 0's value (or every rank's) is the result.

A rank that reported its result runs its exit work before it exits (``worker/rank/exiting.py``):
the run shows it as finishing, and goes on until it exited; the ``timeout`` no longer applies
then, as the rank bounds that work itself (``exit_timeout``). What went wrong there comes as
the outcome's ``exit_warnings``. A rank still there ``EXIT_GRACE`` seconds past its bound (its
watchdog could not run: a handler that holds the GIL in native code) is given up on: the run
succeeds with a warning, and the teardown kills it.

The same referee judges ranks on this machine (fed by a ``RankGroup`` on the loop's thread)
and on a cluster (fed by what the nodes forward). What it shares with a session task's judge
is in :mod:`nbddp.rules.judging`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nbddp import interrupts
from nbddp.backend import Outcome, RunEvents
from nbddp.errors import LaunchTimeout
from nbddp.errors.render import describe_exit
from nbddp.rules.graceful import GracefulStop
from nbddp.rules.judging import SETTLE, Clock, Judging
from nbddp.wire.messages import AllJoined, ExitReport, Failed, Joined, Result, Trained, Unsendable
from nbddp.wire.spec import JobSpec

if TYPE_CHECKING:
    from nbddp.plan import LaunchPlan

# Seconds past a rank's own exit bound before the kernel stops waiting for it.
EXIT_GRACE = 5.0


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
        exit_timeout: float = JobSpec.exit_timeout,
        stop_grace: float = 60.0,
    ) -> None:
        super().__init__(world_size, return_all, timeout, events, node_of, clock, broadcast)
        self.graceful = GracefulStop(world_size, broadcast, events, clock, stop_grace)
        self._returned: set[int] = set()
        self._broadcast = broadcast
        self._groups_to_start = started_groups
        self._settled: float | None = None
        self._joined: set[int] = set()
        self._exit_timeout = exit_timeout
        self._finishing: dict[int, float] = {}  # rank -> when its exit work began
        self.exit_warnings: list[str] = []

    @classmethod
    def for_plan(
        cls,
        plan: LaunchPlan,
        events: RunEvents,
        broadcast: Callable[[Any], None],
        node_of: Callable[[int], str | None] = lambda rank: None,
    ) -> Referee:
        """The referee of a launch of ``plan``: a group (machine) per node starts."""
        return cls(
            plan.world_size,
            plan.return_all,
            plan.timeout,
            events,
            broadcast,
            started_groups=plan.nodes,
            node_of=node_of,
            exit_timeout=plan.exit_timeout,
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
            case Joined():
                self._joined.add(rank)
                if len(self._joined) == self.world_size:
                    self._broadcast(AllJoined())
                    interrupts.reached("running fn")
            case Trained(check=check):
                self.tracker.trained(rank, check)
                interrupts.reached("sending the result")
            case Result(stream=stream, early_exit=early):
                interrupts.reached("exit work")
                self._returned.add(rank)
                self.graceful.returned(rank)
                self.tracker.result(rank, stream, buffers, early)
                self._finishing[rank] = self._clock()
                self._events.finishing(frozenset(self._finishing))
            case ExitReport(problems=problems):
                self.exit_warnings += [f"rank {rank}'s exit: {p}." for p in problems]
            case Failed(report=report):
                self.tracker.raised(rank, report, self._node_of(rank))
            case Unsendable(path=path, reason=reason):
                self.tracker.unsendable(rank, path, reason)

    def _ended(self, rank: int, code: int | None, stderr_tail: str) -> None:
        if self._finishing.pop(rank, None) is not None:
            self._events.finishing(frozenset(self._finishing))
            if code != 0:
                self.exit_warnings.append(
                    f"rank {rank} {describe_exit(code)} while it ran its exit handlers, after "
                    "its result: what they were writing may be incomplete."
                )
        self.graceful.gone(rank)
        self.tracker.ended(rank, code, stderr_tail, self._node_of(rank))

    def _started(self) -> None:
        self._groups_to_start -= 1
        if self._groups_to_start == 0:
            interrupts.reached("joining the process group")
            self._events.started()

    def deadline(self) -> float | None:
        if self.tracker.all_returned:  # the timeout is fn's: the exit work has its own bound
            times = [t for t in (self._settled, self._given_up) if t is not None]
            return min(times) if times else None
        if self.graceful.why is not None and self._timed_out():  # the grace bounds it now
            return self._earliest_of(self._settled, self.graceful.deadline())
        return self._earliest(self._settled, self.graceful.deadline())

    @staticmethod
    def _earliest_of(*times: float | None) -> float | None:
        known = [t for t in times if t is not None]
        return min(known) if known else None

    @property
    def _given_up(self) -> float | None:
        """When the kernel stops waiting for the ranks still finishing their exit work."""
        if not self._finishing or not self.tracker.all_returned:
            return None
        return max(self._finishing.values()) + self._exit_timeout + EXIT_GRACE

    def verdict(self) -> Outcome | None:
        tracker = self.tracker
        self.graceful.send(self._joined, tracker.exited, self._returned)
        if tracker.failures and not self.in_pdb:  # held while a person debugs a rank
            self._settled = self._settled or self._clock() + SETTLE
            if tracker.everyone_accounted_for or self._clock() >= self._settled:
                return Outcome("failed", error=tracker.root_cause().error)
            return None  # a failure is decided: only the choice of root cause is left
        if self.stop_requested:
            return Outcome("stopped")
        if len(tracker.exited) == self.world_size:
            return self._collect()
        if tracker.all_returned:  # exit work, bounded by the ranks (and _given_up)
            given_up = self._given_up
            if given_up is not None and self._clock() >= given_up:
                for rank in sorted(self._finishing):
                    self.exit_warnings.append(
                        f"rank {rank} was still running its exit work "
                        f"{self._exit_timeout + EXIT_GRACE:g} s after its result "
                        f"(NBDDP_EXIT_TIMEOUT={self._exit_timeout:g} s, plus {EXIT_GRACE:g}): "
                        "killed. An exit handler may hold the GIL in native code."
                    )
                return self._collect()
            return None
        at_once = self.graceful.at_once()
        by_timeout = self._timed_out()
        if at_once is not None and by_timeout:
            assert self._timeout is not None
            ended = f"all workers were terminated: {at_once}"
            return Outcome("failed", error=LaunchTimeout(self._timeout, ended))
        if at_once is not None:
            return Outcome("stopped", warning=f"it was stopped at once: {at_once}.")
        if by_timeout and self.graceful.why is None:  # first, a graceful stop
            self.graceful.request(f"the timeout of {self._timeout:g} s")
            self.graceful.send(self._joined, tracker.exited, self._returned)
            return self.verdict()
        return None

    def _collect(self) -> Outcome:
        outcome = self.tracker.collect()._replace(exit_warnings=tuple(self.exit_warnings))
        if outcome.status == "succeeded" and self.graceful.landed is not None:
            return outcome._replace(status="stopped", graceful=self.graceful.sentence())
        return outcome
