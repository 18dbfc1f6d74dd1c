"""The rules of a session's ranks over their life, on a fake clock: the start (every rank
joined, or a failure first), a task finished or losing the ranks, a death or a lost node
between tasks, and closing idle ranks within their exit bound. No process, no waiting."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from nbddp import WorkerError
from nbddp.rules.referee import EXIT_GRACE
from nbddp.rules.session_judge import SessionJudge
from nbddp.rules.task_referee import GRACE, TaskReferee
from nbddp.wire.messages import (
    DeviceName,
    Ended,
    ErrorReport,
    ExitReport,
    Failed,
    Joined,
    Names,
    NodeLost,
    RankStatus,
    Received,
    Result,
)

pytestmark = pytest.mark.unit

WORLD = 2
EXIT_TIMEOUT = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class News:
    """The session's side: what the judge told it, in order."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def on_ready(self) -> None:
        self.told.append("ready")

    def on_device(self, name: str) -> None:
        self.told.append(("device", name))

    def on_names(self, names: frozenset[str]) -> None:
        self.told.append(("names", names))

    def on_status(self, rank: int, status: RankStatus) -> None:
        self.told.append(("status", rank))

    def drain_output(self) -> None:
        self.told.append("drained")


class Events:
    output = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


def report() -> ErrorReport:
    return ErrorReport("ValueError", "boom", "", None, 0.0, ("builtins.ValueError",), "builtins")


def joined(rank: int) -> Received:
    return Received(rank, Joined(rank), [])


def failed(rank: int) -> Received:
    return Received(rank, Failed(rank, report()), [])


def result(rank: int, value: Any = None) -> Received:
    return Received(rank, Result(rank, pickle.dumps(value), False), [])


def judge_for(clock: Clock) -> tuple[SessionJudge, News]:
    news = News()
    return SessionJudge(WORLD, EXIT_TIMEOUT, news, clock=clock), news


def started(clock: Clock) -> tuple[SessionJudge, News]:
    judge, news = judge_for(clock)
    for rank in range(WORLD):
        judge.event(joined(rank))
    assert news.told == ["ready"] and judge.verdict() is None
    return judge, news


def with_task(judge: SessionJudge, clock: Clock) -> list[Any]:
    finished: list[Any] = []
    referee = TaskReferee(WORLD, False, None, Events(), lambda: None, clock=clock)  # type: ignore[arg-type]
    judge.begin_task(referee, finished.append)
    return finished


# -- the start ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "verdict", "ready"),
    [
        ([joined(0)], None, False),  # rank 1 is still starting
        ([joined(0), joined(1)], None, True),  # up: the session waits for tasks
        ([joined(0), failed(1)], "start failed", True),
        ([Ended(1, -9, "")], "start failed", True),  # died before it joined
        ([joined(0), joined(1), Ended(1, -9, "")], "died", True),  # after: between tasks
    ],
)
def test_the_start_is_over_when_every_rank_joined_or_one_failed_first(events, verdict, ready):
    judge, news = judge_for(Clock())
    for event in events:
        judge.event(event)
    assert judge.verdict() == verdict
    assert ("ready" in news.told) == ready


def test_a_failed_start_names_the_rank_that_failed():
    judge, _ = judge_for(Clock())
    judge.event(joined(0))
    judge.event(failed(1))
    error = judge.start_failures.root_cause().error
    assert isinstance(error, WorkerError) and error.rank == 1


# -- between tasks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (Ended(1, -9, ""), "rank 1 was killed by signal 9"),
        (NodeLost((2, 3), "10.0.0.2", "gone"), "rank 2 stopped without reporting a result"),
    ],
)
def test_a_rank_lost_between_tasks_ends_the_session_and_says_why(event, why):
    judge, _ = started(Clock())
    judge.event(event)
    assert judge.verdict() == "died"
    assert judge.why_ended("closed").startswith(why)
    assert judge.left_to_report() is None


def test_news_goes_to_the_session_whatever_runs():
    judge, news = started(Clock())
    judge.event(Received(0, DeviceName(0, "NVIDIA H100"), []))
    judge.event(Received(0, Names(0, ("model", "data")), []))
    judge.event(Received(1, RankStatus(1, False, 0, None), []))
    assert news.told[1:] == [
        ("device", "NVIDIA H100"),
        ("names", frozenset({"model", "data"})),
        ("status", 1),
    ]
    assert judge.verdict() is None


# -- a task ------------------------------------------------------------------------------------


def test_a_task_every_rank_answered_is_finished_and_the_ranks_stay():
    clock = Clock()
    judge, news = started(clock)
    finished = with_task(judge, clock)
    judge.event(result(0, 7))
    assert judge.verdict() is None and finished == []
    judge.event(result(1))
    assert judge.verdict() is None  # the session goes on
    assert [v.outcome.value for v in finished] == [7] and news.told[-1] == "drained"
    assert judge.idle and judge.left_to_report() is None


@pytest.mark.parametrize(("after", "verdict"), [(GRACE - 0.01, None), (GRACE, "restart")])
def test_a_task_whose_ranks_stay_stuck_past_GRACE_restarts_them_reported_after(after, verdict):
    clock = Clock()
    judge, _ = started(clock)
    finished = with_task(judge, clock)
    judge.event(failed(0))  # rank 1 never comes back to idle
    clock.now += after
    assert judge.verdict() == verdict
    assert finished == []  # a lost task is reported only once the ranks are torn down
    if verdict is not None:
        lost, finish = judge.left_to_report()
        assert lost.stuck == (1,) and lost.lost
        assert "rank 1 did not return to idle" in judge.why_ended("restart")
        finish(lost)
        assert finished == [lost]


def test_a_task_running_when_the_loop_ends_is_reported_stopped_with_every_rank():
    clock = Clock()
    judge, _ = started(clock)
    with_task(judge, clock)
    judge.close()
    assert judge.verdict() == "closed"
    verdict, _ = judge.left_to_report()
    assert verdict.outcome.status == "stopped" and verdict.stuck == (0, 1)
    assert judge.left_to_report() is None  # once


# -- closing idle ranks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exits", "after", "verdict", "warnings"),
    [
        ([], EXIT_TIMEOUT + EXIT_GRACE - 0.01, None, 0),  # still within their bound
        ([Ended(0, 0, ""), Ended(1, 0, "")], 0.5, "closed", 0),  # every rank exited
        ([Ended(0, 0, ""), Ended(1, -9, "")], 0.5, "closed", 1),  # one was killed in its exit
        ([Ended(0, 0, "")], EXIT_TIMEOUT + EXIT_GRACE, "closed", 1),  # rank 1 given up on
    ],
)
def test_closing_idle_ranks_waits_for_their_exit_within_the_bound(exits, after, verdict, warnings):
    clock = Clock()
    judge, _ = started(clock)
    judge.close_idle()
    assert judge.deadline() == clock.now + EXIT_TIMEOUT + EXIT_GRACE
    for event in exits:
        judge.event(event)
    clock.now += after
    assert judge.verdict() == verdict
    assert len(judge.take_exit_warnings()) == warnings
    assert judge.take_exit_warnings() == []  # once


def test_what_went_wrong_in_the_exit_work_is_a_warning():
    judge, _ = started(Clock())
    judge.close_idle()
    judge.event(Received(1, ExitReport(1, ("an exit handler raised OSError",)), []))
    assert judge.take_exit_warnings() == ["rank 1's exit: an exit handler raised OSError."]


def test_the_deadline_is_the_running_tasks_or_the_exit_bound():
    clock = Clock()
    judge, _ = started(clock)
    assert judge.deadline() is None
    referee = TaskReferee(WORLD, False, 10.0, Events(), lambda: None, clock=clock)  # type: ignore[arg-type]
    judge.begin_task(referee, lambda verdict: None)
    assert judge.deadline() == clock.now + 10.0
