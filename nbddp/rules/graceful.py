"""The kernel's half of a graceful stop (the ranks' half, and why it is safe:
``worker/recovery/stopping.py``), as a launch's referee keeps it.

A stop is asked from any thread (``request``: the Stop button, ``run.stop(graceful=True)``, the
first interrupt, the timeout, Slurm's signal before the time limit); the referee sends it on
its loop's thread (``send``): ``StopAsked`` to every rank. Every rank that joined answers with
its count of checks; once all did, the agreed check ``StopAt(max + 1)`` goes to every rank.

It is not graceful, and the referee ends the run at once, when: a rank had not started ``fn``
or never checked (count 0: known as soon as one rank says it); a rank had already returned
(the run is ending: there is no step left to agree on); a rank did not answer within
``ANSWER`` seconds (its listener cannot run: the GIL held in native code); or the ranks have
not all ended ``stop_grace`` seconds after the ask.

Non-goal: threads and sockets. Fed on the loop's thread, timed by the referee's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbddp.backend import RunEvents
from nbddp.recovery import Saved, stopped_gracefully
from nbddp.wire.stopping import Checkpointed, Checks, StopAsked, StopAt, StoppedAt, StopRequested

ANSWER = 5.0  # seconds every rank's listener has to answer StopAsked


class GracefulStop:
    """One launch's graceful stop, from the ask to the agreed step (or to "at once")."""

    def __init__(
        self,
        world_size: int,
        broadcast: Callable[[Any], None],
        events: RunEvents,
        clock: Callable[[], float],
        grace: float,
    ) -> None:
        self._world_size = world_size
        self._broadcast = broadcast
        self._events = events
        self._clock = clock
        self._grace = grace
        self._pending: str | None = None  # asked from another thread, not sent yet
        self.why: str | None = None  # by what it was asked, once sent
        self._asked_at = 0.0
        self._waiting: set[int] = set()  # ranks whose count has not come
        self._counts: dict[int, int] = {}
        self.agreed: int | None = None
        self._refused = ""  # why it cannot be graceful
        self.landed: tuple[int, str] | None = None  # rank 0's (step, what checked)
        self.saved: list[Saved] = []  # rank 0's checkpoints after the ask, whoever saved them

    def request(self, why: str) -> None:
        """Ask for it (any thread; the caller wakes the loop). The first ask counts."""
        if self._pending is None and self.why is None:
            self._pending = why

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def send(self, joined: set[int], exited: set[int], returned: set[int]) -> None:
        """On the loop's thread: send a pending ask to the ranks that run ``fn``."""
        if self._pending is None:
            return
        self.why, self._pending = self._pending, None
        self._asked_at = self._clock()
        self._events.stopping(self.why)
        if returned:
            self._refused = "a rank had already returned (the run was ending)"
            return
        if len(joined) < self._world_size:
            self._refused = "not every rank had started the function yet"
            return
        self._waiting = joined - exited
        self._broadcast(StopAsked())
        self._check_counts()

    def heard(self, rank: int, message: Any) -> bool:
        """Take a rank's message of the agreement (its count, a signal's ask, where it
        stopped) or of a checkpoint (rank 0's goes to the panel); False for any other."""
        match message:
            case Checks(checks=count):
                self.answered(rank, count)
            case StopRequested(why=why):  # a signal to the rank (Slurm's, before the limit)
                self.request(why)
            case StoppedAt(step=step, where=where):
                self.stopped_at(rank, step, where)
            case Checkpointed(step=step, path=path, seconds=seconds, restored=restored, by=by):
                if rank == 0:
                    if not by:  # the panel's line is the run's checkpoint directory's
                        self._events.checkpointed(step, path, seconds, restored)
                    if not restored:
                        self.checkpointed(step, path, by)
            case _:
                return False
        return True

    def answered(self, rank: int, count: int) -> None:
        if rank not in self._waiting:
            return
        self._waiting.discard(rank)
        self._counts[rank] = count
        self._check_counts()

    def returned(self, rank: int) -> None:
        """A rank returned while the ranks were asked: the run is ending, not stopping at a
        step (unless the agreed step was reached: then the stop landed)."""
        if self.why is not None and self.agreed is None and not self._refused:
            self._refused = "a rank returned before the ranks agreed on a step"

    def gone(self, rank: int) -> None:
        """A rank ended: no answer will come from it."""
        if rank in self._waiting:
            self._waiting.discard(rank)
            self._check_counts()

    def _check_counts(self) -> None:
        if self.agreed is not None or self._refused or self.why is None:
            return
        never = sorted(rank for rank, count in self._counts.items() if count == 0)
        if never:  # at once, whatever the others will answer
            ranks = ", ".join(map(str, never))
            self._refused = (
                f"rank{'s' if len(never) > 1 else ''} {ranks} had not checked nbddp.stopping() "
                "or nbddp.progress yet"
            )
        elif self._counts and not self._waiting:
            self.agreed = max(self._counts.values()) + 1
            self._broadcast(StopAt(self.agreed))

    def stopped_at(self, rank: int, step: int, where: str) -> None:
        if rank == 0:
            self.landed = (step, where)

    def checkpointed(self, step: int, path: str, by: str = "") -> None:
        if self.why is not None:
            self.saved.append((step, path, by))

    def at_once(self) -> str | None:
        """Why the run must now end at once instead (e.g. "rank 1 had not checked ..."),
        else None; the referee says what "at once" did."""
        if self.why is None:
            return None
        if self._refused:
            return self._refused
        now = self._clock()
        if self._waiting and now >= self._asked_at + ANSWER:
            ranks = ", ".join(map(str, sorted(self._waiting)))
            return f"rank(s) {ranks} did not answer within {ANSWER:g} s"
        if now >= self._asked_at + self._grace:
            return (
                f"its ranks had not ended {self._grace:g} s after the graceful stop was asked "
                "(stop_grace)"
            )
        return None

    def deadline(self) -> float | None:
        if self._pending is not None:
            return self._clock()
        if self.why is None:
            return None
        if self._waiting:
            return min(self._asked_at + ANSWER, self._asked_at + self._grace)
        return self._asked_at + self._grace

    def sentence(self) -> str:
        """The warning of a run that stopped gracefully: where, why, and what it saved."""
        step, where = self.landed or (0, "nbddp.stopping()")
        return stopped_gracefully(step, where, self.why or "a stop", self.saved)
