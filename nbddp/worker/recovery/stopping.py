"""``nbddp.stopping()``: a graceful stop that every rank sees at the same step, at no cost per
step beyond counting.

A *check* is a call of ``stopping()``, a step of ``nbddp.progress``, or a step of a trainer
nbddp knows (``trainers.py``). Each rank counts its checks; while no stop is asked a check is
one increment and one flag read: no collective, no message, no lock.

When a stop is asked, every rank hears it on its listener thread (``StopAsked``), raises its
flag and answers at once with its count ``c`` (``Checks``). The kernel takes the largest count
and tells every rank ``StopAt(S)``, ``S = max(c) + 1``; every rank's check number ``S`` (and
every later one) is True. So all ranks stop at the same check, the pocket-tts pattern (stop at
a step boundary, together) without its all-reduce at every step.

Why no rank passes check ``S`` before it knows ``S``: the training thread counts a check before
it reads the flag, and the listener raises the flag before it reads the count. A check that
read no flag was therefore counted in ``c``, and ``S > c``: its False was right. A check that
read the flag and whose number is ``<= c`` is False for the same reason; the one numbered
``c + 1`` waits for ``S``. That wait cannot deadlock: ``S`` needs only the ranks' listener
threads, never another rank's training thread (which may be blocked in a collective until this
rank goes on).

A rank that never checked answers 0, and the kernel ends the run at once instead (the rule for
runs that do not check). Outside a launch nothing asks, and ``stopping()`` is False; an
exported script installs its own way of asking (``standalone.py``).
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from nbddp.wire.stopping import Checks, StopAsked, StopAt, StoppedAt

__all__ = ["stopping"]

Announce = Callable[[int, str], None]  # (step, what checked): the rank's first True check


class Agreement:
    """One run's stop agreement on this rank: the count of checks and, once asked, the
    agreed check. ``announce`` is told of the first True check (the rank tells the kernel)."""

    __slots__ = (
        "_announce",
        "_announced",
        "_cond",
        "_floor",
        "_stop_at",
        "calls",
        "checks",
        "pending",
    )

    def __init__(self, announce: Announce | None = None) -> None:
        self.checks = 0  # checks passed; written by the training thread only
        self.calls = 0  # stopping() calls, the step it reports
        self.pending = False  # a stop was asked; written under the lock only
        self._floor = 0  # this rank's count when it heard: the agreed check is beyond it
        self._stop_at: int | None = None
        # Reentrant: the one-rank run's interrupt handler asks from the training thread itself.
        self._cond = threading.Condition(threading.RLock())
        self._announce = announce
        self._announced = False

    def check(self, step: int, where: str) -> bool:
        """One check on the training thread: True from the agreed check on."""
        self.checks = n = self.checks + 1  # counted before the flag is read (see the module)
        if not self.pending:
            return False
        return self._at_stop(n, step, where)

    def _at_stop(self, n: int, step: int, where: str) -> bool:
        with self._cond:
            while self._stop_at is None:
                if n <= self._floor:
                    return False  # the agreed check lies beyond every count, ours included
                self._cond.wait(1.0)
            if n < self._stop_at:
                return False
            first, self._announced = not self._announced, True
        if first and self._announce is not None:
            self._announce(step, where)
        return True

    # the listener's side (or the kernel's own, for the run in the kernel)

    def asked(self) -> int:
        """A stop is asked: raise the flag, and return this rank's count (0: never checked)."""
        with self._cond:
            if not self.pending:
                self.pending = True
                self._floor = self.checks  # read after the flag was raised
            return self._floor

    def agree(self, check: int) -> None:
        """The agreed check: this rank's check number ``check`` is its first True one."""
        with self._cond:
            self.pending = True
            if self._stop_at is None:
                self._stop_at = check
            self._cond.notify_all()

    def ask_here(self) -> bool:
        """A one-rank run: asked and agreed at once, at the next check. False when it never
        checked (the run is then ended at once instead)."""
        with self._cond:
            count = self.asked()
            if count == 0:
                return False
            self.agree(count + 1)
            return True

    @property
    def agreed(self) -> int | None:
        return self._stop_at

    @property
    def landed(self) -> bool:
        """A check on this rank was True: the run stopped before its end."""
        return self._announced


def for_rank(send: Callable[[Any], None], rank: int) -> Agreement:
    """A rank's agreement (a launch's, or one session task's): its first True check is told
    to the kernel."""
    return Agreement(lambda step, where: send(StoppedAt(rank, step, where)))


def listened(
    message: Any, agreement: Agreement | None, rank: int, send: Callable[[Any], None]
) -> bool:
    """The rank's listener thread's half: ``StopAsked`` answered at once with this rank's
    count (0 where nothing runs that checks), ``StopAt`` passed on; False for any other
    message."""
    if isinstance(message, StopAsked):
        send(Checks(rank, agreement.asked() if agreement is not None else 0))
    elif isinstance(message, StopAt):
        if agreement is not None:
            agreement.agree(message.check)
    else:
        return False
    return True


_agreement: Agreement | None = None


def install(agreement: Agreement | None) -> Agreement | None:
    """Make ``agreement`` this process's (a rank's entry, the one-rank run, an exported
    script); returns the previous one."""
    global _agreement
    previous, _agreement = _agreement, agreement
    return previous


def current() -> Agreement | None:
    return _agreement


def stopping() -> bool:
    """Whether the run is being stopped gracefully: check it at every step boundary.

    It turns True on every rank at the same step once a graceful stop was agreed: asked by
    ``run.stop(graceful=True)``, the panel's Stop button, the first kernel interrupt,
    ``timeout=``, or Slurm's signal before the time limit. It stays True, so the code after
    the loop can save: ``if nbddp.stopping(): break`` in the loop, then
    ``nbddp.checkpoint(...)``. A check costs a counter and a flag: no collective, no message.
    A run that never checks is ended at once instead.

    Returns:
        True from the agreed step on; False while no stop is agreed, and outside a launch.
    """
    agreement = _agreement
    if agreement is None:
        return False
    agreement.calls = calls = agreement.calls + 1
    return agreement.check(calls, "nbddp.stopping()")


SIGNALLED = "Slurm's signal before the time limit (SIGUSR1)"


def ask_on_signal(ask: Callable[[], None], signum: int = signal.SIGUSR1) -> None:
    """``signum`` (Slurm's ``--signal=USR1@T`` before the time limit) asks for a graceful
    stop: ``ask`` runs once, on a thread of its own (a handler must not send: the main thread
    it interrupts may hold the channel's lock). Call it from the main thread."""
    told: list[bool] = []

    def handler(number: int, frame: FrameType | None) -> None:
        if not told:
            told.append(True)
            _thread.start_new_thread(ask, ())  # no threading lock: the handler may interrupt one

    signal.signal(signum, handler)


def check(step: int, where: str) -> bool:
    """One check by a loop nbddp drives (``progress``, a trainer's step): ``step`` is what it
    reports as the step it stopped at."""
    agreement = _agreement
    return agreement is not None and agreement.check(step, where)
