"""A session's ranks: started once, then serving one task after another.

Where they run is the session's :class:`~nbddp.backend.Ranks`, picked by
:func:`~nbddp.launch.ranks_for` exactly as a launch's are (with ``session=True``): on this
machine one :class:`~nbddp.local.group.RankGroup` kept for the session's life; on a cluster each
node's helper keeping its group. Their loop runs on a thread of its own, judged by a
:class:`_Dispatcher` that hands each task's events to that task's
:class:`~nbddp.rules.task_referee.TaskReferee` and watches the ranks between tasks (one that
dies while idle ends the session's ranks). When a task's ranks are stuck, or came back with
their collectives out of step (``rules/in_step.py``), the loop ends, which tears the ranks down,
and only then is the task's outcome reported: a user who sees the error never waits on a
leftover process.

Closing idle ranks is their normal end: each is sent ``Close`` and runs its exit work (exit
handlers, then the processes it started get SIGTERM; ``worker/exiting.py``), bounded by the
plan's ``exit_timeout``, and the loop ends once every rank exited (or ``EXIT_GRACE`` seconds
past the bound). A running task, a failure or a lost kernel end them at once, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nbddp.backend import Outcome, Ranks, RunEvents
from nbddp.errors import NbddpError, describe_exit, our_bug, warn_user
from nbddp.launch import ranks_for
from nbddp.plan import LaunchPlan
from nbddp.rules.judging import write_out
from nbddp.rules.referee import EXIT_GRACE
from nbddp.rules.task_referee import TaskReferee, TaskVerdict, restart_cause, trigger
from nbddp.rules.tracker import RunTracker
from nbddp.wire.call import Call
from nbddp.wire.messages import (
    Close,
    DeviceName,
    Ended,
    ExitReport,
    Failed,
    GroupCount,
    Interrupt,
    Joined,
    Names,
    NodeLost,
    Printed,
    Probe,
    RankEvent,
    RankStatus,
    Received,
    Task,
)

PROBE_WAIT = 2.0  # seconds ranks get to answer a status probe

Finish = Callable[[TaskVerdict], None]


class _Dispatcher:
    """The loop's judge for the session's whole life (called on the loop's thread only, but
    for the attributes the kernel's thread sets before it wakes the loop)."""

    def __init__(self, ranks: SessionRanks) -> None:
        self._ranks = ranks
        self.joined: set[int] = set()
        self.ready = threading.Event()
        self.start_failures = RunTracker(ranks.world_size, False)
        self.task: TaskReferee | None = None
        self.finish: Finish | None = None
        self.left_over: tuple[TaskVerdict, Finish] | None = None  # reported after teardown
        self.died_idle: Ended | None = None
        self.closing = False
        self.leaving: float | None = None  # closing idle ranks: when to stop waiting for them
        self.exited: set[int] = set()
        self.exit_warnings: list[str] = []

    def event(self, event: RankEvent) -> None:
        ranks = self._ranks
        match event:
            case Received(rank=rank, message=Joined()):
                self.joined.add(rank)
                if len(self.joined) == ranks.world_size:
                    self.ready.set()
                return
            case Received(message=DeviceName(name=name)):
                ranks.device_name = name
                return
            case Received(message=Names(names=names)):
                ranks.names = frozenset(names)
                return
            case Received(rank=rank, message=RankStatus() as status):
                ranks.statuses[rank] = status
                if len(ranks.statuses) == ranks.world_size:
                    ranks.probed.set()
                return
            case Printed(text=text):  # a node's ranks' output (cluster sessions)
                write_out(self.task.output if self.task is not None else None, text)
                return
            case Received(rank=rank, message=ExitReport(problems=problems)):
                self.exit_warnings += [f"rank {rank}'s exit: {p}." for p in problems]
                return
            case Ended(rank=rank, code=code) if self.leaving is not None:
                self.exited.add(rank)
                if code != 0:
                    self.exit_warnings.append(
                        f"rank {rank} {describe_exit(code)} while it ran its exit handlers: "
                        "what they were writing may be incomplete."
                    )
                return
        if not self.ready.is_set():  # failing before every rank joined: the start failed
            match event:
                case Received(rank=rank, message=Failed(report=report)):
                    self.start_failures.raised(rank, report)
                case Ended(rank=rank, code=code, stderr_tail=tail):
                    self.start_failures.ended(rank, code, tail)
            if self.start_failures.failures:
                self.ready.set()
        elif self.task is not None:
            self.task.event(event)
        elif isinstance(event, Ended):
            self.died_idle = event
        elif isinstance(event, NodeLost):  # between tasks: the session's ranks are broken
            self.died_idle = Ended(event.ranks[0], None, f"lost with its node {event.node}")

    def deadline(self) -> float | None:
        if self.leaving is not None:
            return self.leaving
        return self.task.deadline() if self.task is not None else None

    def verdict(self) -> str | None:
        if self.task is not None:
            verdict = self.task.verdict()
            if verdict is not None:
                finish, self.finish, self.task = self.finish, None, None
                assert finish is not None
                self._ranks.processes.drain_output()  # what the ranks printed before answering
                if verdict.lost:
                    self.left_over = (verdict, finish)
                    return "restart"
                finish(verdict)
        if self.start_failures.failures:
            return "start failed"
        if self.died_idle is not None:
            return "died"
        if self.leaving is not None:
            world = range(self._ranks.world_size)
            if len(self.exited) < len(world) and time.monotonic() < self.leaving:
                return None
            for rank in (r for r in world if r not in self.exited):
                self.exit_warnings.append(
                    f"rank {rank} was still running its exit work {EXIT_GRACE:g} s past its "
                    "bound (NBDDP_EXIT_TIMEOUT): killed. An exit handler may hold the GIL in "
                    "native code."
                )
            return "closed"
        return "closed" if self.closing else None


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
        self.processes = processes or ranks_for(
            plan, Call(b""), session=True
        )  # the calls come as tasks
        self._exit_timeout = plan.exit_timeout
        self._dispatcher = _Dispatcher(self)
        self._loop = threading.Thread(target=self._serve, name="nbddp-session", daemon=True)
        self._task_ids = iter(range(1, 1 << 62))

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks and wait until every one joined the process group; raises (after
        ending them) if one fails first. An interrupt ends them too."""
        try:
            self.processes.start()
            self._loop.start()
            while not self._dispatcher.ready.wait(0.1):
                if not self._loop.is_alive():
                    break
        except BaseException:
            self.close()
            raise
        failures = self._dispatcher.start_failures
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
        dispatcher = self._dispatcher
        on_loop = threading.current_thread() is self._loop
        if self.alive and dispatcher.task is None and dispatcher.leaving is None and not on_loop:
            dispatcher.leaving = time.monotonic() + self._exit_timeout + EXIT_GRACE
            self.processes.send_all(Close())
            self._loop.join()  # until every rank exited (or the bound passed)
        dispatcher.closing = True
        self.processes.stop()
        if self._loop.is_alive() and not on_loop:
            self._loop.join()
        self.processes.teardown()
        if self.ended is None:
            self.ended = "closed"
        warnings, dispatcher.exit_warnings = dispatcher.exit_warnings, []
        for message in warnings:
            warn_user(message)

    def _serve(self) -> None:
        dispatcher = self._dispatcher
        try:
            why = self.processes.serve(dispatcher) or "closed"
        except BaseException as exc:  # a bug of ours must still end the ranks cleanly
            self.failure = our_bug("session loop", exc)  # kept with its traceback
            why = str(self.failure)
        finally:
            self.processes.teardown()
        if dispatcher.died_idle is not None:
            event = dispatcher.died_idle

            why = f"rank {event.rank} {describe_exit(event.code)} while the session was idle"
        elif dispatcher.left_over is not None:
            why = restart_cause(dispatcher.left_over[0], trigger(dispatcher.left_over[0].outcome))
        self.ended = why
        if dispatcher.left_over is not None:
            verdict, finish = dispatcher.left_over
            finish(verdict)
        elif dispatcher.finish is not None:  # closed while a task ran
            finish, dispatcher.finish, dispatcher.task = dispatcher.finish, None, None
            finish(TaskVerdict(Outcome("stopped"), tuple(range(self.world_size)), ()))

    # -- tasks -------------------------------------------------------------------------------

    def run_task(
        self,
        kind: str,
        call: Call,
        sources: dict[str, tuple[Any, ...]],
        plan: LaunchPlan,
        events: RunEvents,
        finish: Finish,
    ) -> TaskReferee:
        """Send one task to every rank; ``finish`` is called once with its verdict."""
        task_id = next(self._task_ids)
        task = Task(task_id, kind, call.stream, sources, call.layout, plan.return_all, plan.output)
        referee = TaskReferee.for_plan(
            plan,
            events,
            interrupt=lambda: self.processes.send_all(Interrupt(task_id)),
            node_of=self.processes.node_of,
            issued=self.issued,
        )
        self.processes.set_output(plan.output, events.output)

        def done(verdict: TaskVerdict) -> None:
            if self.alive:
                self.processes.set_output("rank0")  # between tasks: the notebook's streams
            finish(verdict)

        self._dispatcher.finish = done
        self._dispatcher.task = referee
        self.processes.send_task(task, call)
        return referee

    def stop_task(self, referee: TaskReferee) -> None:
        referee.stop()
        self.processes.wake()

    def probe(self) -> dict[int, RankStatus]:
        """Each rank's status, as far as it answers within ``PROBE_WAIT`` seconds."""
        self.statuses = {}
        self.probed.clear()
        if self.alive:
            self.processes.send_all(Probe())
            self.probed.wait(PROBE_WAIT)
        return dict(self.statuses)
