"""The :class:`~nbddp.backend.Backend` of a launch with rank processes, wherever they run.

:class:`Supervised` starts the :class:`~nbddp.backend.Ranks` and one supervisor thread that
serves them, judged by a :class:`~nbddp.rules.referee.Referee` made from the plan. It ends the
run exactly once: with the referee's verdict, "stopped" on a stop, or with our own bug (kept
with its traceback) when the loop itself failed; the ranks are torn down before ``finish``.
On this machine and on a cluster alike: where the ranks run is the ``Ranks``' business, what
the run's end means the referee's.

With ``max_restarts``, a run that failed because of its ranks (a rank raised or died, a node
was lost: a :class:`~nbddp.errors.WorkerError`) is started again as a whole world, fresh
ranks from ``remake``, up to that many times, as torchrun's ``--max-restarts`` does;
``nbddp.restore`` in ``fn`` resumes it. The ``timeout`` spans every attempt. A stop, the
timeout, or our own bug are never restarted.

Non-goal: sockets and processes (``local/``, ``clusters/``), and the rules (``rules/``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nbddp import interrupts
from nbddp.backend import Finish, Outcome, Ranks, RunEvents
from nbddp.errors import WorkerError
from nbddp.errors.notices import our_bug
from nbddp.plan import LaunchPlan
from nbddp.rules.referee import Referee
from nbddp.wire.stacks import AskStacks


class Supervised:
    """One launch's ranks from start to teardown, served on a supervisor thread.
    ``remake`` gives fresh ranks for a restart (``plan.max_restarts``)."""

    def __init__(
        self, plan: LaunchPlan, ranks: Ranks, remake: Callable[[], Ranks] | None = None
    ) -> None:
        self.plan = plan
        self._ranks = ranks
        self._remake = remake
        self._referee: Referee | None = None
        self._lock = threading.Lock()  # the current ranks and referee, against stop()
        self._stopped = False
        self._events: RunEvents | None = None
        self._deadline: float | None = None  # the timeout's, across restarts

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._ranks.nodes

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Start every rank, then the supervisor. Cleans up if anything fails (an interrupt
        included: it lands after the start's whole steps, or the cleanup)."""
        plan, ranks = self.plan, self._ranks
        self._events = events
        supervisor: threading.Thread | None = None
        try:
            ranks.set_output(plan.output, events.output)
            ranks.start()
            with interrupts.deferred():  # a SIGINT inside Thread.start() breaks its lock
                # the timeout counts from here: waiting for a helper or a reservation is not fn's
                if plan.timeout is not None:
                    self._deadline = time.monotonic() + plan.timeout
                referee = self._new_referee()
                supervisor = threading.Thread(
                    target=self._supervise,
                    args=(referee, finish),
                    name="nbddp-supervisor",
                    daemon=True,
                )
                supervisor.start()
                interrupts.reached("supervising")
        except BaseException:
            if supervisor is not None and supervisor.is_alive():  # interrupted after the start
                self.stop()
                with interrupts.deferred():
                    supervisor.join()
            else:  # what started, and whatever is open; nothing will call finish
                ranks.teardown()
            raise

    def _new_referee(self) -> Referee:
        assert self._events is not None
        ranks = self._ranks
        referee = Referee.for_plan(self.plan, self._events, ranks.send_all, ranks.node_of)
        if self._deadline is not None:  # the timeout spans every attempt
            referee.expire_at(self._deadline)
        with self._lock:
            self._referee = referee
        return referee

    def ask(self, message: AskStacks) -> None:
        """A roll-call: every rank answers, and a rank that cannot is dumped by a signal."""
        self._ranks.send_all(message)

    def tell(self, message: Any) -> None:
        """A reply to a rank's prompt, or a release of held ranks: to every rank (on a
        cluster, over each node's stream)."""
        self._ranks.send_all(message)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            referee, ranks = self._referee, self._ranks
        if referee is not None:
            referee.stop()
        ranks.stop()

    def stop_gracefully(self, why: str) -> None:
        with self._lock:
            referee, ranks = self._referee, self._ranks
        if referee is not None:
            referee.stop_gracefully(why)
            ranks.wake()

    def _supervise(self, referee: Referee, finish: Finish) -> None:
        restarts = 0
        while True:
            outcome = self._serve(referee)
            if not self._restartable(outcome, restarts):
                finish(outcome)
                return
            restarts += 1
            assert self._events is not None and outcome.error is not None
            self._events.restarted(restarts, self.plan.max_restarts, outcome.error)
            try:
                restarted = self._restart()
            except BaseException as exc:  # a world that cannot start again ends the run
                finish(Outcome("failed", error=exc))
                return
            if restarted is None:  # stopped while the last world ended: nothing starts
                finish(Outcome("stopped"))
                return
            referee = restarted

    def _serve(self, referee: Referee) -> Outcome:
        ranks = self._ranks
        outcome = Outcome("failed")
        try:
            outcome = ranks.serve(referee) or Outcome("stopped")
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            outcome = Outcome("failed", error=our_bug("supervisor", exc))
        finally:
            interrupts.reached("tearing down")
            ranks.teardown()
        return outcome

    def _restartable(self, outcome: Outcome, restarts: int) -> bool:
        with self._lock:
            stopped = self._stopped
        return (
            outcome.status == "failed"
            and isinstance(outcome.error, WorkerError)
            and restarts < self.plan.max_restarts
            and self._remake is not None
            and not stopped
        )

    def _restart(self) -> Referee | None:
        """A fresh world: new ranks from ``remake``, started, with a new referee (None: the
        run was stopped meanwhile)."""
        assert self._remake is not None and self._events is not None
        ranks = self._remake()
        with self._lock:
            self._ranks, self._referee = ranks, None
            if self._stopped:
                return None
        try:
            ranks.set_output(self.plan.output, self._events.output)
            ranks.start()
        except BaseException:
            ranks.teardown()
            raise
        return self._new_referee()
