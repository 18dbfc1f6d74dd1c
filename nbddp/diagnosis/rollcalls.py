"""A run's roll-calls: asked on demand (``run.stacks()``, the panel's Where button), by the
stall watch behind the banner, just before the timeout (for ``LaunchTimeout.stacks``) and
once as a stalled run is stopped (for ``RunStopped.stacks`` and the interrupt's).

Non-goal: the run's state and its view, reached through the callables it is given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nbddp.diagnosis.answers import Answers
from nbddp.diagnosis.stacks import Stacks
from nbddp.diagnosis.stall import StallWatch
from nbddp.wire.stacks import AskStacks

NATIVE_WAIT = 25.0  # more seconds ranks get to answer with py-spy's native frames
TIMEOUT_LEAD = 2.0  # seconds before a timeout at which the roll-call for err.stacks is taken


class RollCalls:
    """One run's roll-calls. ``ask_ranks`` sends one to every rank, ``show_where`` puts one
    in the panel (with the time the stall began, or None), ``ended`` says the run is over."""

    def __init__(
        self,
        world_size: int,
        answers: Answers,
        ask_ranks: Callable[[AskStacks], None],
        show_where: Callable[[str, float | None], None],
        ended: Callable[[], bool],
    ) -> None:
        self._world_size = world_size
        self._answers = answers
        self._ask_ranks = ask_ranks
        self._show_where = show_where
        self._ended = ended
        self.watch: StallWatch | None = None
        self._timer: threading.Timer | None = None
        self.before_timeout: Stacks | None = None  # taken just before a timeout
        self.at_stop: Stacks | None = None  # taken as a stalled run is stopped
        self._stop_asked = False
        # start and cancel come from different threads (the cell's, the run's end): a start
        # after the cancel must start nothing, or its watch would run for ever
        self._lock = threading.Lock()
        self._cancelled = False

    def start(
        self, stall_after: float | None, timeout: float | None, progress: Callable[[], float]
    ) -> None:
        """The stall banner, and a roll-call just before the timeout ends the ranks (nothing
        once the run ended: :meth:`cancel` came first)."""
        with self._lock:
            if self._cancelled:
                return
            if stall_after is not None:
                self.watch = StallWatch(stall_after, progress, self.ask, self._show_stall)
            if timeout is not None:
                lead = min(TIMEOUT_LEAD, timeout / 2)
                self._timer = threading.Timer(timeout - lead, self._before_timeout, (lead,))
                self._timer.daemon = True
                self._timer.start()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for helper in (self.watch, self._timer):
                if helper is not None:
                    helper.cancel()

    def ask(self, timeout: float, native: bool = False) -> Stacks:
        if self._ended():
            return Stacks(self._world_size, {}, note="the run has ended: there is no rank to ask")
        query = self._answers.open()
        self._ask_ranks(AskStacks(query, native))
        wait = timeout + (NATIVE_WAIT if native else 0)
        return Stacks(self._world_size, self._answers.wait(query, wait))

    def where_button(self) -> None:
        stacks = self.ask(5.0)
        if not self._ended():
            stamp = time.strftime("%H:%M:%S", time.localtime(stacks.taken_at))
            self._show_where(f"Where the ranks were at {stamp}:\n{stacks.rollcall()}", None)

    def if_stalled(self, timeout: float = 2.0) -> None:
        """Once, as the run is stopped: a fresh roll-call if its stall banner shows."""
        if self._stop_asked or self.watch is None or self.watch.stalled is None:
            return
        self._stop_asked = True
        self.at_stop = self.ask(timeout)

    def _show_stall(self, stacks: Stacks | None, quiet: float) -> None:
        if stacks is None:
            self._show_where("", None)
        else:
            self._show_where(stacks.rollcall(), time.time() - quiet)

    def _before_timeout(self, lead: float) -> None:
        if not self._ended():
            self.before_timeout = self.ask(lead * 0.8)
