"""A session's ranks: started once, then serving one task after another.

Where they run is the session's :class:`~nbddp.backend.Ranks`, picked by
:func:`~nbddp.ranks.ranks_for` exactly as a launch's are (with ``session=True``): on this
machine one :class:`~nbddp.local.group.RankGroup` kept for the session's life; on a cluster
each node's helper keeping its group. Their loop runs on a thread of its own, judged for the
session's whole life by a :class:`~nbddp.rules.session_judge.SessionJudge`, which hands each
task's events to that task's :class:`~nbddp.rules.task_referee.TaskReferee` and decides when the
ranks are gone (a task lost them, one died between tasks, they were closed). This module is
the mechanism around it: the loop's thread, what the kernel's thread waits on (the start, a
status probe), and the task's finish once the ranks are torn down.

Closing idle ranks is their normal end: each is sent ``Close`` and runs its exit work (exit
handlers, then the processes it started get SIGTERM; ``worker/rank/exiting.py``), bounded by the
plan's ``exit_timeout``. A running task, a failure or a lost kernel end them at once.
"""

from __future__ import annotations

import threading
from typing import Any

from nbddp.backend import Ranks, RunEvents
from nbddp.errors import NbddpError
from nbddp.errors.notices import our_bug, warn_user
from nbddp.plan import LaunchPlan
from nbddp.ranks import ranks_for
from nbddp.rules.session_judge import SessionJudge, TaskFinish
from nbddp.rules.task_referee import TaskReferee, TaskVerdict
from nbddp.wire.call import Call
from nbddp.wire.messages import Close, GroupCount, Interrupt, Probe, RankStatus, Task

PROBE_WAIT = 2.0  # seconds ranks get to answer a status probe


class SessionRanks:
    """The ranks of one session, from start to end. ``run_task`` and ``probe`` are called
    from the kernel's thread, one task at a time."""

    def __init__(self, plan: LaunchPlan, processes: Ranks | None = None) -> None:
        self.world_size = plan.world_size
        self.device_name = "cpu" if plan.device == "cpu" else "GPU"
        self.names: frozenset[str] = frozenset()  # what rank 0's namespace holds
        self.statuses: dict[int, RankStatus] = {}
        self.issued: dict[int, tuple[GroupCount, ...] | None] = {}  # each rank's last Issued
        self.probed = threading.Event()
        self.ended: str | None = None  # why the ranks are gone, once they are
        self.failure: NbddpError | None = None  # our own bug that ended them, if one did
        # where they run (the calls come as tasks)
        self.processes = processes or ranks_for(plan, Call(b""), session=True)
        self._ready = threading.Event()
        self._judge = SessionJudge(plan.world_size, plan.exit_timeout, self)
        self._loop = threading.Thread(target=self._serve, name="nbddp-session", daemon=True)
        self._task_ids = iter(range(1, 1 << 62))
        self._called = False

    def first_call(self) -> bool:
        """Whether the call about to go is these ranks' first: it carries the kernel's random
        state; later tasks keep the ranks' own streams (``wire/torch_settings.py``)."""
        first, self._called = not self._called, True
        return first

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks and wait until every one joined the process group; raises (after
        ending them) if one fails first. An interrupt ends them too."""
        try:
            self.processes.start()
            self._loop.start()
            while not self._ready.wait(0.1):
                if not self._loop.is_alive():
                    break
        except BaseException:
            self.close()
            raise
        failures = self._judge.start_failures
        if failures.failures:
            self.close()
            raise failures.root_cause().error.with_traceback(None)
        if self.ended is not None:
            raise NbddpError(
                f"the session's ranks ended while starting ({self.ended})."
            ) from self.failure

    @property
    def alive(self) -> bool:
        return self.ended is None and self._loop.is_alive()

    @property
    def pids(self) -> dict[int, int]:
        return self.processes.pids

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.processes.nodes

    def close(self) -> None:
        """End the ranks. Idle ones end normally: each runs its exit handlers (bounded; what
        went wrong there is a warning). A running task is reported as stopped, its ranks
        ended at once. Idempotent."""
        judge = self._judge
        on_loop = threading.current_thread() is self._loop
        if self.alive and judge.idle and not on_loop:
            judge.close_idle()
            self.processes.send_all(Close())
            self._loop.join()  # until every rank exited (or the bound passed)
        judge.close()
        self.processes.stop()
        if self._loop.is_alive() and not on_loop:
            self._loop.join()
        self.processes.teardown()
        if self.ended is None:
            self.ended = "closed"
        for message in judge.take_exit_warnings():
            warn_user(message)

    def _serve(self) -> None:
        judge = self._judge
        try:
            why: str = self.processes.serve(judge) or "closed"
        except BaseException as exc:  # a bug of ours must still end the ranks cleanly
            self.failure = our_bug("session loop", exc)  # kept with its traceback
            why = str(self.failure)
        finally:
            self.processes.teardown()
        self.ended = judge.why_ended(why)
        left = judge.left_to_report()
        if left is not None:
            verdict, finish = left
            finish(verdict)

    # -- what the judge tells (on the loop's thread) -------------------------------------------

    def on_ready(self) -> None:
        self._ready.set()

    def on_device(self, name: str) -> None:
        self.device_name = name

    def on_names(self, names: frozenset[str]) -> None:
        self.names = names

    def on_status(self, rank: int, status: RankStatus) -> None:
        self.statuses[rank] = status
        if len(self.statuses) == self.world_size:
            self.probed.set()

    def drain_output(self) -> None:
        self.processes.drain_output()

    # -- tasks -------------------------------------------------------------------------------

    def run_task(
        self,
        kind: str,
        call: Call,
        sources: dict[str, tuple[Any, ...]],
        plan: LaunchPlan,
        events: RunEvents,
        finish: TaskFinish,
    ) -> TaskReferee:
        """Send one task to every rank; ``finish`` is called once with its verdict."""
        task_id = next(self._task_ids)
        task = Task(
            task_id,
            kind,
            call.stream,
            sources,
            call.layout,
            plan.return_all,
            plan.output,
            plan.debug,
        )
        referee = TaskReferee.for_plan(
            plan,
            events,
            interrupt=lambda: self.processes.send_all(Interrupt(task_id)),
            node_of=self.processes.node_of,
            issued=self.issued,
            tell=self.processes.send_all,
        )
        self.processes.set_output(plan.output, events.output)

        def done(verdict: TaskVerdict) -> None:
            if self.alive:
                self.processes.set_output("rank0")  # between tasks: the notebook's streams
            finish(verdict)

        self._judge.begin_task(referee, done)
        self.processes.send_task(task, call)
        return referee

    def stop_task(self, referee: TaskReferee) -> None:
        referee.stop()
        self.processes.wake()

    def stop_task_gracefully(self, referee: TaskReferee, why: str) -> None:
        referee.stop_gracefully(why)
        self.processes.wake()

    def probe(self) -> dict[int, RankStatus]:
        """Each rank's status, as far as it answers within ``PROBE_WAIT`` seconds."""
        self.statuses = {}
        self.probed.clear()
        if self.alive:
            self.processes.send_all(Probe())
            self.probed.wait(PROBE_WAIT)
        return dict(self.statuses)
