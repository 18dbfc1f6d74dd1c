"""The backend of one session task: the ranks already run, so starting it is handing them the
task, and its end is the task's verdict (a :class:`~nbddp.rules.task_referee.TaskVerdict`).
``Run`` drives it exactly as it drives a launch's backend.
"""

from __future__ import annotations

from typing import Any

from nbddp.backend import Finish, RunEvents
from nbddp.errors import WorkerError
from nbddp.plan import LaunchPlan
from nbddp.rules.task_referee import TaskReferee, TaskVerdict, restart_note, trigger
from nbddp.sessions.ranks import SessionRanks
from nbddp.wire import payload
from nbddp.wire.call import Call


class SessionTask:
    """The :class:`~nbddp.backend.Backend` of one session task: the ranks already run."""

    def __init__(self, ranks: SessionRanks, kind: str, call: Call, plan: LaunchPlan) -> None:
        self._ranks = ranks
        self.nodes = ranks.nodes
        self._kind = kind
        self._call = call
        self._plan = plan
        self._referee: TaskReferee | None = None
        self._finish: Finish | None = None
        self.verdict: TaskVerdict | None = None

    def start(self, events: RunEvents, finish: Finish) -> None:
        self._finish = finish
        sources = payload.notebook_sources()
        self._referee = self._ranks.run_task(
            self._kind, self._call, sources, self._plan, events, self._done
        )
        events.started()

    def _done(self, verdict: TaskVerdict) -> None:
        self.verdict = verdict
        error = verdict.outcome.error
        if verdict.lost and isinstance(error, WorkerError):
            error.hint = (error.hint + "\n" if error.hint else "") + restart_note(
                verdict, trigger(verdict.outcome)
            )
        assert self._finish is not None
        self._finish(verdict.outcome)

    def stop(self) -> None:
        if self._referee is not None:
            self._ranks.stop_task(self._referee)

    def stop_gracefully(self, why: str) -> None:
        """Every rank returns at one agreed step, and the session keeps its state; a task
        that does not check is interrupted at once, as by ``stop``."""
        if self._referee is not None:
            self._ranks.stop_task_gracefully(self._referee, why)

    def ask(self, message: Any) -> None:
        self._ranks.processes.send_all(message)

    def tell(self, message: Any) -> None:
        self._ranks.processes.send_all(message)
