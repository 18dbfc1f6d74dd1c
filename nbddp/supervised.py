"""The :class:`~nbddp.backend.Backend` of a launch with rank processes, wherever they run.

:class:`Supervised` starts the :class:`~nbddp.backend.Ranks` and one supervisor thread that
serves them, judged by a :class:`~nbddp.rules.referee.Referee` made from the plan. It ends the
run exactly once: with the referee's verdict, "stopped" on a stop, or with our own bug (kept
with its traceback) when the loop itself failed; the ranks are torn down before ``finish``.
On this machine and on a cluster alike: where the ranks run is the ``Ranks``' business, what
the run's end means the referee's.

Non-goal: sockets and processes (``local/``, ``clusters/``), and the rules (``rules/``).
"""

from __future__ import annotations

import threading
from typing import Any

from nbddp import interrupts
from nbddp.backend import Finish, Outcome, Ranks, RunEvents
from nbddp.errors.notices import our_bug
from nbddp.plan import LaunchPlan
from nbddp.rules.referee import Referee
from nbddp.wire.stacks import AskStacks


class Supervised:
    """One launch's ranks from start to teardown, served on a supervisor thread."""

    def __init__(self, plan: LaunchPlan, ranks: Ranks) -> None:
        self.plan = plan
        self._ranks = ranks
        self._referee: Referee | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._ranks.nodes

    def start(self, events: RunEvents, finish: Finish) -> None:
        """Start every rank, then the supervisor. Cleans up if anything fails (an interrupt
        included: it lands after the start's whole steps, or the cleanup)."""
        plan, ranks = self.plan, self._ranks
        supervisor: threading.Thread | None = None
        try:
            ranks.set_output(plan.output, events.output)
            ranks.start()
            with interrupts.deferred():  # a SIGINT inside Thread.start() breaks its lock
                # the timeout counts from here: waiting for a helper or a reservation is not fn's
                referee = Referee.for_plan(plan, events, ranks.send_all, ranks.node_of)
                self._referee = referee
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

    def ask(self, message: AskStacks) -> None:
        """A roll-call: every rank answers, and a rank that cannot is dumped by a signal."""
        self._ranks.send_all(message)

    def tell(self, message: Any) -> None:
        """A reply to a rank's prompt, or a release of held ranks: to every rank (on a
        cluster, over each node's stream)."""
        self._ranks.send_all(message)

    def stop(self) -> None:
        if self._referee is not None:
            self._referee.stop()
        self._ranks.stop()

    def _supervise(self, referee: Referee, finish: Finish) -> None:
        outcome = Outcome("failed")
        try:
            outcome = self._ranks.serve(referee) or Outcome("stopped")
        except BaseException as exc:  # a bug of ours must still end the run cleanly
            outcome = Outcome("failed", error=our_bug("supervisor", exc))
        finally:
            interrupts.reached("tearing down")
            self._ranks.teardown()
            finish(outcome)
