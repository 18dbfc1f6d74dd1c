"""The rules of a session's ranks over their whole life: starting, each task, between tasks,
and their end.

One :class:`SessionJudge` judges the session's rank loop from the start to the close:

* the start: the ranks are up once every rank joined the process group; a rank that fails or
  dies before that fails the start (the root cause chosen as a launch's is);
* a task: its events go to that task's :class:`~nbddp.rules.task_referee.TaskReferee`; once it
  decides, the task is finished, unless the ranks were lost with it (stuck, died, collectives
  out of step): then the loop ends ("restart"), and the task is reported after the teardown,
  so a user who sees the error never waits on a leftover process;
* between tasks: a rank that dies, or a node that is lost, breaks the session ("died");
* closing idle ranks: each runs its exit work; the loop ends once every rank exited, or
  ``EXIT_GRACE`` seconds past their bound, with a warning for each that had not ("closed").

Non-goal: threads, processes and what the kernel's thread waits on (``sessions/ranks.py``,
told through :class:`SessionNews`). The clock is a parameter, so the rules are tested without
waiting (``tests/rules/test_session_judge.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, Protocol

from nbddp.backend import Outcome
from nbddp.errors.render import describe_exit
from nbddp.rules.judging import Clock, write_out
from nbddp.rules.referee import EXIT_GRACE
from nbddp.rules.task_referee import TaskReferee, TaskVerdict, restart_cause, trigger
from nbddp.rules.tracker import RunTracker
from nbddp.wire.messages import (
    DeviceName,
    Ended,
    ExitReport,
    Failed,
    Joined,
    Names,
    NodeLost,
    Printed,
    RankEvent,
    RankStatus,
    Received,
)

# Why the loop ended: a task lost the ranks; they failed to start; one died (or its node was
# lost) between tasks; they were closed.
SessionEnd = Literal["restart", "start failed", "died", "closed"]
TaskFinish = Callable[[TaskVerdict], None]


class SessionNews(Protocol):
    """What the session learns from its judge, on the loop's thread."""

    def on_ready(self) -> None:
        """Every rank joined the process group, or the start failed."""

    def on_device(self, name: str) -> None:
        """Rank 0's device, for a task's header."""

    def on_names(self, names: frozenset[str]) -> None:
        """The names rank 0's namespace holds now."""

    def on_status(self, rank: int, status: RankStatus) -> None:
        """A rank's answer to a status probe."""

    def drain_output(self) -> None:
        """Show what the ranks printed so far (a task's answers arrived)."""


class SessionJudge:
    """Judges a session's ranks for their whole life: a :class:`~nbddp.backend.Judge` whose
    verdict is a :data:`SessionEnd`. Called on the loop's thread, but for :meth:`begin_task`,
    :meth:`close_idle` and :meth:`close`, which the kernel's thread calls before it wakes the
    loop (the ranks' ``wake``)."""

    def __init__(
        self,
        world_size: int,
        exit_timeout: float,
        news: SessionNews,
        clock: Clock = time.monotonic,
    ) -> None:
        self.world_size = world_size
        self._exit_timeout = exit_timeout
        self._news = news
        self._clock = clock
        self._joined: set[int] = set()
        self._ready = False
        self.start_failures = RunTracker(world_size, False)
        self.task: TaskReferee | None = None
        self._finish: TaskFinish | None = None
        self._lost: tuple[TaskVerdict, TaskFinish] | None = None  # reported after teardown
        self._reported = False
        self._died_idle: Ended | None = None
        self._closing = False
        self.leaving: float | None = None  # closing idle ranks: when to stop waiting for them
        self._exited: set[int] = set()
        self._exit_warnings: list[str] = []

    # -- from the kernel's thread --------------------------------------------------------------

    def begin_task(self, referee: TaskReferee, finish: TaskFinish) -> None:
        """A task is sent: its events go to ``referee``; ``finish`` gets its verdict once."""
        self._finish = finish
        self.task = referee

    def close_idle(self) -> None:
        """The idle ranks were sent ``Close``: wait for them to exit, up to their bound."""
        self.leaving = self._clock() + self._exit_timeout + EXIT_GRACE

    def close(self) -> None:
        """The session closes: the loop ends (``stop`` ends it at once too)."""
        self._closing = True

    @property
    def idle(self) -> bool:
        """No task runs and the ranks are not being closed."""
        return self.task is None and self.leaving is None

    def take_exit_warnings(self) -> list[str]:
        """What went wrong in the ranks' exit work, once."""
        warnings, self._exit_warnings = self._exit_warnings, []
        return warnings

    # -- the loop ------------------------------------------------------------------------------

    def event(self, event: RankEvent) -> None:
        if self._news_of(event):
            return
        if not self._ready:  # failing before every rank joined: the start failed
            match event:
                case Received(rank=rank, message=Failed(report=report)):
                    self.start_failures.raised(rank, report)
                case Ended(rank=rank, code=code, stderr_tail=tail):
                    self.start_failures.ended(rank, code, tail)
            if self.start_failures.failures:
                self._set_ready()
        elif self.task is not None:
            self.task.event(event)
        elif isinstance(event, Ended):
            self._died_idle = event
        elif isinstance(event, NodeLost):  # between tasks: the session's ranks are broken
            self._died_idle = Ended(event.ranks[0], None, f"lost with its node {event.node}")

    def _news_of(self, event: RankEvent) -> bool:
        """What the session takes note of whatever runs; False for the rest."""
        match event:
            case Received(rank=rank, message=Joined()):
                self._joined.add(rank)
                if len(self._joined) == self.world_size:
                    self._set_ready()
            case Received(message=DeviceName(name=name)):
                self._news.on_device(name)
            case Received(message=Names(names=names)):
                self._news.on_names(frozenset(names))
            case Received(rank=rank, message=RankStatus() as status):
                self._news.on_status(rank, status)
            case Printed(text=text):  # a node's ranks' output (cluster sessions)
                write_out(self.task.output if self.task is not None else None, text)
            case Received(rank=rank, message=ExitReport(problems=problems)):
                self._exit_warnings += [f"rank {rank}'s exit: {p}." for p in problems]
            case Ended(rank=rank, code=code) if self.leaving is not None:
                self._exited.add(rank)
                if code != 0:
                    self._exit_warnings.append(
                        f"rank {rank} {describe_exit(code)} while it ran its exit handlers: "
                        "what they were writing may be incomplete."
                    )
            case _:
                return False
        return True

    def _set_ready(self) -> None:
        self._ready = True
        self._news.on_ready()

    def deadline(self) -> float | None:
        if self.leaving is not None:
            return self.leaving
        return self.task.deadline() if self.task is not None else None

    def verdict(self) -> SessionEnd | None:
        if self.task is not None and self._task_lost_the_ranks():
            return "restart"
        if self.start_failures.failures:
            return "start failed"
        if self._died_idle is not None:
            return "died"
        if self.leaving is not None:
            return self._closed()
        return "closed" if self._closing else None

    def _task_lost_the_ranks(self) -> bool:
        """Finish the task if its referee decided; True when its ranks cannot be kept."""
        assert self.task is not None
        verdict = self.task.verdict()
        if verdict is None:
            return False
        finish, self._finish, self.task = self._finish, None, None
        assert finish is not None
        self._news.drain_output()  # what the ranks printed before answering goes first
        if verdict.lost:
            self._lost = (verdict, finish)
            return True
        finish(verdict)
        return False

    def _closed(self) -> SessionEnd | None:
        assert self.leaving is not None
        world = range(self.world_size)
        if len(self._exited) < len(world) and self._clock() < self.leaving:
            return None
        for rank in (r for r in world if r not in self._exited):
            self._exit_warnings.append(
                f"rank {rank} was still running its exit work {EXIT_GRACE:g} s past its "
                "bound (NBDDP_EXIT_TIMEOUT): killed. An exit handler may hold the GIL in "
                "native code."
            )
        return "closed"

    # -- after the loop ------------------------------------------------------------------------

    def why_ended(self, otherwise: str) -> str:
        """Why the ranks are gone, for the user (``otherwise``: what the loop's end says)."""
        if self._died_idle is not None:
            event = self._died_idle
            return f"rank {event.rank} {describe_exit(event.code)} while the session was idle"
        if self._lost is not None:
            verdict = self._lost[0]
            return restart_cause(verdict, trigger(verdict.outcome))
        return otherwise

    def left_to_report(self) -> tuple[TaskVerdict, TaskFinish] | None:
        """Once the loop ended and the ranks are gone: the task still to finish, with its
        verdict (one that lost the ranks, or one still running: stopped, every rank lost)."""
        if self._reported:
            return None
        self._reported = True
        if self._lost is not None:
            return self._lost
        if self._finish is not None:  # closed while a task ran
            finish, self._finish, self.task = self._finish, None, None
            stopped = TaskVerdict(Outcome("stopped"), tuple(range(self.world_size)), ())
            return stopped, finish
        return None
