"""The timing rules of the two judges, on a fake clock: a launch's settle window and timeout,
a session task's grace, stuck and dead ranks, and a lost node. No process, no waiting."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from nbddp import LaunchTimeout, WorkerError
from nbddp.rules.judging import COLLATERAL, SETTLE
from nbddp.rules.referee import Referee
from nbddp.rules.task_referee import GRACE, TaskReferee
from nbddp.wire.messages import (
    AllJoined,
    Ended,
    ErrorReport,
    Failed,
    GroupCount,
    Issued,
    Joined,
    NodeLost,
    Received,
    Result,
    Started,
)
from nbddp.wire.prompts import LeftPdb, Prompt, Quit, Reply
from nbddp.wire.stopping import Checks

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Events:
    """The run's state model, reduced to what a judge calls."""

    output = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append(name)


def report(exc_type: str = "ValueError") -> ErrorReport:
    return ErrorReport(exc_type, "boom", "", None, 0.0, (f"builtins.{exc_type}",), "builtins")


def failed(rank: int) -> Received:
    return Received(rank, Failed(rank, report()), [])


def result(rank: int, value: Any = None) -> Received:
    return Received(rank, Result(rank, pickle.dumps(value), False), [])


def referee(clock: Clock, world: int = 2, timeout: float | None = None) -> Referee:
    sent: list[Any] = []
    judge = Referee(world, False, timeout, Events(), sent.append, clock=clock)  # type: ignore[arg-type]
    judge.sent = sent  # type: ignore[attr-defined]
    return judge


def test_a_launch_succeeds_when_every_rank_reported_and_exited():
    clock = Clock()
    judge = referee(clock)
    judge.event(Received(0, Joined(0), []))
    judge.event(Received(1, Joined(1), []))
    assert judge.sent == [AllJoined()]  # type: ignore[attr-defined]
    judge.event(result(0, "value"))
    judge.event(result(1))
    judge.event(Ended(0, 0, ""))
    assert judge.verdict() is None  # rank 1 has not exited yet
    judge.event(Ended(1, 0, ""))
    outcome = judge.verdict()
    assert outcome is not None and (outcome.status, outcome.value) == ("succeeded", "value")


@pytest.mark.parametrize(
    ("then", "after", "decided"),
    [
        (None, SETTLE - 0.01, False),  # the peer may still explain it: wait
        (None, SETTLE, True),  # the settle window is over
        (Ended(1, 1, ""), 0.0, True),  # every rank is accounted for: no more news can come
    ],
)
def test_the_first_failure_settles_for_SETTLE_seconds(then, after, decided):
    clock = Clock()
    judge = referee(clock)
    judge.event(failed(0))
    assert judge.verdict() is None  # rank 1 may still explain it
    assert judge.deadline() == pytest.approx(clock.now + SETTLE)
    judge.event(Ended(0, 1, ""))
    if then is not None:
        judge.event(then)
    clock.now += after
    outcome = judge.verdict()
    assert (outcome is not None) == decided
    if decided:
        assert outcome.status == "failed" and isinstance(outcome.error, WorkerError)
        assert outcome.error.rank == 0


@pytest.mark.parametrize(("after", "timed_out"), [(9.99, False), (10.0, True)])
def test_a_launch_times_out_at_its_deadline(after, timed_out):
    clock = Clock()
    judge = referee(clock, timeout=10.0)
    assert judge.deadline() == clock.now + 10.0
    clock.now += after
    outcome = judge.verdict()
    assert (outcome is not None) == timed_out
    if timed_out:
        assert isinstance(outcome.error, LaunchTimeout)


def test_a_stop_request_ends_a_launch_as_stopped_but_a_failure_wins():
    clock = Clock()
    judge = referee(clock)
    judge.stop()
    assert judge.verdict().status == "stopped"
    judge.event(failed(1))
    judge.event(Ended(0, -15, ""))
    judge.event(Ended(1, 1, ""))
    assert judge.verdict().status == "failed"


def test_started_groups_all_report_before_the_run_is_running():
    events = Events()
    judge = Referee(4, False, None, events, lambda m: None, started_groups=2)  # type: ignore[arg-type]
    judge.event(Started())
    assert "started" not in events.calls
    judge.event(Started())
    assert events.calls.count("started") == 1


@pytest.mark.parametrize("judge_kind", ["launch", "task"])
def test_a_lost_node_fails_its_ranks_with_the_node_named(judge_kind):
    clock = Clock()
    if judge_kind == "launch":
        judge: Any = referee(clock, world=4)
    else:
        judge = TaskReferee(4, False, None, Events(), lambda: None, clock=clock)  # type: ignore[arg-type]
    judge.event(NodeLost((2, 3), "10.0.0.2", "ActorDiedError: gone"))
    assert judge.verdict() is None  # ranks 0 and 1 may still say what they saw
    clock.now += SETTLE
    outcome = judge.verdict()
    outcome = outcome.outcome if judge_kind == "task" else outcome
    assert outcome is not None and outcome.status == "failed"
    assert outcome.error.node == "10.0.0.2" and outcome.error.rank in (2, 3)
    assert "lost with its node 10.0.0.2" in str(outcome.error)


def task(clock: Clock, world: int = 2, timeout: float | None = None) -> TaskReferee:
    interrupts: list[int] = []
    judge = TaskReferee(
        world,
        False,
        timeout,
        Events(),  # type: ignore[arg-type]
        lambda: interrupts.append(1),
        clock=clock,
    )
    judge.interrupts = interrupts  # type: ignore[attr-defined]
    return judge


def test_a_task_is_over_when_every_rank_answered_and_no_rank_exits():
    clock = Clock()
    judge = task(clock)
    judge.event(result(0, 7))
    assert judge.verdict() is None
    judge.event(result(1))
    verdict = judge.verdict()
    assert verdict is not None and verdict.outcome.value == 7 and verdict.stuck == ()


@pytest.mark.parametrize(
    ("answers", "after", "expected"),
    [
        # the peer came back to idle within the grace: the state is kept
        ([result(1)], 0.0, ((), ())),
        # the peer is still inside a collective after the grace: stuck, restart
        ([], GRACE - 0.01, None),
        ([], GRACE, ((1,), ())),
    ],
)
def test_after_a_failure_the_other_ranks_get_GRACE_to_come_back(answers, after, expected):
    clock = Clock()
    judge = task(clock)
    judge.event(failed(0))
    assert judge.interrupts == [1]  # type: ignore[attr-defined]
    for answer in answers:
        judge.event(answer)
    clock.now += after
    verdict = judge.verdict()
    if expected is None:
        assert verdict is None
        return
    assert verdict is not None and (verdict.stuck, verdict.died) == expected
    assert verdict.outcome.status == "failed" and verdict.outcome.error.rank == 0
    assert judge.interrupts == [1]  # type: ignore[attr-defined]  # once, however many events


def test_a_rank_that_dies_in_a_task_leaves_the_others_only_SETTLE():
    clock = Clock()
    judge = task(clock)
    judge.event(Ended(1, -9, ""))
    assert judge.deadline() == pytest.approx(clock.now + SETTLE)
    clock.now += SETTLE
    verdict = judge.verdict()
    assert verdict is not None and verdict.died == (1,) and verdict.stuck == (0,)


def issued(rank: int, count: int) -> Received:
    """Rank ``rank`` issued ``count`` collectives on the default group of two."""
    return Received(rank, Issued(rank, (GroupCount("0", (0, 1), count),)), [])


@pytest.mark.parametrize(
    ("answered", "counts", "kept"),
    [
        # back to idle, every collective matched: the ranks and their state stay
        (True, (3, 3), "kept their state"),
        # back to idle, but rank 0 issued one rank 1 never did: out of step, fresh ranks
        (True, (4, 3), "the state on the ranks is lost"),
        # still inside a collective after the grace: stuck, fresh ranks
        (False, (3, 3), "the state on the ranks is lost"),
    ],
)
def test_a_task_timeout_interrupts_and_says_whether_the_state_survived(answered, counts, kept):
    clock = Clock()
    judge = task(clock, timeout=3.0)
    clock.now += 3.0
    assert judge.verdict() is None  # a graceful stop is asked first
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 0), []))  # the task never checks
    assert judge.verdict() is None  # interrupted now; the grace begins
    assert judge.interrupts == [1]  # type: ignore[attr-defined]
    judge.event(issued(0, counts[0]))
    judge.event(issued(1, counts[1]))
    if answered:
        judge.event(failed(0))
        judge.event(failed(1))
    else:
        clock.now += GRACE
    verdict = judge.verdict()
    assert isinstance(verdict.outcome.error, LaunchTimeout)
    assert kept in str(verdict.outcome.error)
    assert verdict.lost == (kept != "kept their state")


def test_a_stopped_task_is_stopped_once_the_ranks_answered():
    clock = Clock()
    judge = task(clock)
    judge.stop()
    assert judge.verdict() is None
    judge.event(failed(0))
    judge.event(failed(1))
    assert judge.verdict().outcome.status == "stopped"


# -- a rank in pdb (#33) ------------------------------------------------------------------


def prompt(rank: int, kind: str = "pdb", seq: int = 1) -> Received:
    return Received(rank, Prompt(rank, seq, kind, "", f"(Pdb rank {rank}) ", ("f.py", 3)), [])


def test_a_failure_waits_while_a_person_debugs_a_rank_then_ends_the_run():
    clock = Clock()
    judge = referee(clock)
    judge.event(prompt(1))
    judge.event(failed(0))
    assert judge.verdict() is None
    clock.now += SETTLE * 10
    assert judge.verdict() is None  # rank 1 is in pdb: the run is held
    judge.event(Received(1, LeftPdb(1, 0, 0), []))
    assert judge.verdict() is None  # the settle window starts now: rank 1 may fail too
    clock.now += SETTLE
    outcome = judge.verdict()
    assert outcome is not None and outcome.status == "failed"


def test_the_timeout_counts_while_a_rank_is_in_pdb():
    clock = Clock()
    judge = referee(clock, timeout=10)
    judge.event(prompt(1))
    clock.now += 10
    outcome = judge.verdict()
    assert outcome is not None and isinstance(outcome.error, LaunchTimeout)


def test_q_in_a_ranks_pdb_stops_the_run_even_with_a_failure_in_flight():
    clock = Clock()
    judge = referee(clock)
    judge.event(prompt(1))
    judge.event(failed(0))
    judge.event(Received(1, Quit(1), []))
    outcome = judge.verdict()
    assert outcome is not None and outcome.status == "stopped"


def test_a_post_mortem_after_the_first_failure_is_declined():
    """The first failing rank is debugged; a peer's error that follows from it (its
    collective broke) is not, or the person would answer one prompt per rank."""
    clock = Clock()
    judge = referee(clock)
    judge.event(failed(1))
    judge.event(prompt(0, "post-mortem", seq=4))
    assert judge.sent == [Reply(0, 4, None, COLLATERAL)]  # type: ignore[attr-defined]
    assert not judge.in_pdb
    judge.event(prompt(0, "input", seq=5))  # input() is no pdb: it holds nothing
    assert not judge.in_pdb


def test_a_rank_that_ends_in_pdb_holds_nothing():
    clock = Clock()
    judge = referee(clock)
    judge.event(prompt(1))
    judge.event(failed(0))
    judge.event(Ended(1, -9, ""))
    outcome = judge.verdict()  # every rank accounted for: no settle window
    assert outcome is not None and outcome.status == "failed"


def test_a_session_tasks_failure_interrupts_nobody_while_a_rank_is_in_pdb():
    clock = Clock()
    judge = task(clock)
    judge.event(prompt(1, "post-mortem"))
    judge.event(failed(0))
    assert judge.verdict() is None
    assert judge.interrupts == []  # type: ignore[attr-defined]  # rank 1 is being debugged
    judge.event(Received(1, LeftPdb(1, 1, 0), []))
    assert judge.verdict() is None
    assert judge.interrupts == [1]  # type: ignore[attr-defined]  # now the task ends
    judge.event(failed(1))
    verdict = judge.verdict()
    assert verdict is not None and verdict.outcome.status == "failed"
