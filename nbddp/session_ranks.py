"""A session's ranks on this machine: started once, then serving one task after another.

One :class:`~nbddp.rankgroup.RankGroup` keeps the ranks and their wire for the session's life;
its loop runs on a thread of its own, judged by a :class:`_Dispatcher` that hands each task's
events to that task's :class:`TaskReferee` and watches the ranks between tasks (one that dies
while idle ends the group). When a task's ranks are stuck, the loop ends, which tears the
ranks down, and only then is the task's outcome reported: a user who sees the error never
waits on a leftover process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .backend import Outcome, RunEvents
from .call import Call
from .errors import LaunchTimeout, NbddpError, describe_exit
from .outcome import RunTracker
from .plan import LaunchPlan
from .processes import Starter
from .rankgroup import RankGroup
from .referee import SETTLE
from .supervisor import local_group
from .wire import (
    Bars,
    DeviceName,
    Ended,
    Failed,
    Interrupt,
    Joined,
    MainRows,
    Names,
    Probe,
    RankEvent,
    RankStatus,
    Received,
    Result,
    Rows,
    Task,
    Unsendable,
)

# How long ranks get to come back to idle after a failure, a stop or an interrupt before
# they count as stuck (e.g. in a collective waiting for a peer that failed) and are restarted.
GRACE = 5.0
PROBE_WAIT = 2.0


class TaskVerdict(NamedTuple):
    outcome: Outcome
    stuck: tuple[int, ...]  # ranks that never answered: the session's ranks must be replaced
    died: tuple[int, ...]  # ranks whose process ended


class TaskReferee:
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
    ) -> None:
        self.world_size = world_size
        self.tracker = RunTracker(world_size, return_all)
        self._events = events
        self._interrupt = interrupt
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout if timeout else None
        self._answered: set[int] = set()
        self._died: set[int] = set()
        self._ending: str | None = None  # "failed", "stopped" or "timeout"
        self._grace_until: float | None = None
        self.stop_requested = False

    def stop(self) -> None:
        self.stop_requested = True

    def event(self, event: RankEvent) -> None:
        events, tracker = self._events, self.tracker
        match event:
            case Received(rank=rank, message=message, buffers=buffers):
                match message:
                    case Rows(first=first, blocks=blocks):
                        events.rows(rank, first, blocks)
                    case MainRows(rows=rows) if rank == 0:
                        events.main_rows(rows)
                    case Bars(bars=bars):
                        events.bars(bars)
                    case Result(stream=stream):
                        tracker.result(rank, stream, buffers, False)
                        self._answered.add(rank)
                    case Failed(report=report):
                        tracker.raised(rank, report)
                        self._answered.add(rank)
                        self._end("failed")
                    case Unsendable(path=path, reason=reason):
                        tracker.unsendable(rank, path, reason)
                        self._answered.add(rank)
                        self._end("failed")
            case Ended(rank=rank, code=code, stderr_tail=tail):
                if rank not in self._answered:  # a rank must never end: it died in the task
                    tracker.ended(rank, code if code != 0 else None, tail)
                self._answered.add(rank)
                self._died.add(rank)
                self._end("failed", SETTLE)

    def _end(self, why: str, grace: float = GRACE) -> None:
        """The task ends early: interrupt who still runs it, and give them ``grace``."""
        now = time.monotonic()
        if self._ending is None:
            self._ending = why
            self._interrupt()
        if self._grace_until is None or now + grace < self._grace_until:
            self._grace_until = now + grace

    def deadline(self) -> float | None:
        times = [t for t in (self._deadline, self._grace_until) if t is not None]
        return min(times) if times else None

    def verdict(self) -> TaskVerdict | None:
        now = time.monotonic()
        if self._ending is None:
            if self.stop_requested:
                self._end("stopped")
            elif self._deadline is not None and now >= self._deadline:
                self._end("timeout")
        everyone = len(self._answered) == self.world_size
        if self._ending is None:
            return TaskVerdict(self.tracker.collect(), (), ()) if everyone else None
        assert self._grace_until is not None
        if not everyone and now < self._grace_until:
            return None
        stuck = tuple(r for r in range(self.world_size) if r not in self._answered)
        return TaskVerdict(self._outcome(), stuck, tuple(sorted(self._died)))

    def _outcome(self) -> Outcome:
        if self._ending == "stopped":
            return Outcome("stopped")
        if self._ending == "timeout":
            assert self._timeout is not None
            if len(self._answered) == self.world_size:
                ended = "the session's ranks were interrupted and kept their state"
            else:
                ended = (
                    f"the session's ranks did not return within {GRACE:g} s of the interrupt, "
                    "so fresh ones were started: the state on the ranks is lost"
                )
            return Outcome("failed", error=LaunchTimeout(self._timeout, ended))
        return Outcome("failed", error=self.tracker.root_cause().error)


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

    def deadline(self) -> float | None:
        return self.task.deadline() if self.task is not None else None

    def verdict(self) -> str | None:
        if self.task is not None:
            verdict = self.task.verdict()
            if verdict is not None:
                finish, self.finish, self.task = self.finish, None, None
                assert finish is not None
                self._ranks.group.drain_output()  # what the ranks printed before answering
                if verdict.stuck or verdict.died:
                    self.left_over = (verdict, finish)
                    return "restart"
                finish(verdict)
        if self.start_failures.failures:
            return "start failed"
        if self.died_idle is not None:
            return "died"
        return "closed" if self.closing else None


class SessionRanks:
    """The ranks of one session on this machine, from start to end. ``run_task`` and
    ``probe`` are called from the kernel's thread, one task at a time."""

    def __init__(self, plan: LaunchPlan, starter: Starter | None = None) -> None:
        self.world_size = plan.world_size
        self.device_name = "cpu" if plan.device == "cpu" else "GPU"
        self.names: frozenset[str] = frozenset()  # what rank 0's namespace holds
        self.statuses: dict[int, RankStatus] = {}
        self.probed = threading.Event()
        self.ended: str | None = None  # why the ranks are gone, once they are
        self.group: RankGroup = local_group(plan, Call(b""), starter, session=True)
        self._dispatcher = _Dispatcher(self)
        self._loop = threading.Thread(target=self._serve, name="nbddp-session", daemon=True)
        self._task_ids = iter(range(1, 1 << 62))

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks and wait until every one joined the process group; raises (after
        ending them) if one fails first. An interrupt ends them too."""
        try:
            self.group.start()
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
            raise NbddpError(f"the session's ranks ended while starting ({self.ended}).")

    @property
    def alive(self) -> bool:
        return self.ended is None and self._loop.is_alive()

    @property
    def busy(self) -> bool:
        return self._dispatcher.task is not None

    @property
    def pids(self) -> dict[int, int]:
        return self.group.pids

    def close(self) -> None:
        """End the ranks (a running task is reported as stopped). Idempotent."""
        self._dispatcher.closing = True
        self.group.stop()
        if self._loop.is_alive() and threading.current_thread() is not self._loop:
            self._loop.join()
        self.group.teardown()
        if self.ended is None:
            self.ended = "closed"

    def _serve(self) -> None:
        dispatcher = self._dispatcher
        try:
            why = self.group.run(dispatcher) or "closed"
        except BaseException as exc:  # a bug of ours must still end the ranks cleanly
            why = f"nbddp's session loop failed: {exc!r}"
        finally:
            self.group.teardown()
        if dispatcher.died_idle is not None:
            event = dispatcher.died_idle

            why = f"rank {event.rank} {describe_exit(event.code)} while the session was idle"
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
        referee = TaskReferee(
            self.world_size,
            plan.return_all,
            plan.timeout,
            events,
            interrupt=lambda: self.group.send_all(Interrupt(task_id)),
        )
        self.group.set_output(plan.output, events.output)

        def done(verdict: TaskVerdict) -> None:
            if self.alive:
                self.group.set_output("rank0")  # between tasks: the notebook's streams
            finish(verdict)

        self._dispatcher.finish = done
        self._dispatcher.task = referee
        self.group.send_all(task, call.fds, then=call.close)
        return referee

    def stop_task(self, referee: TaskReferee) -> None:
        referee.stop()
        self.group.wake()

    def probe(self) -> dict[int, RankStatus]:
        """Each rank's status, as far as it answers within ``PROBE_WAIT`` seconds."""
        self.statuses = {}
        self.probed.clear()
        if self.alive:
            self.group.send_all(Probe())
            self.probed.wait(PROBE_WAIT)
        return dict(self.statuses)
