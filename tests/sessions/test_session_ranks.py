"""A session's ranks as a mechanism, on fake ranks (no process): the start waits for every
rank to join and fails with the root cause otherwise, a task that loses the ranks is reported
only once they are torn down, and closing idle ranks waits for their exit. The rules
themselves are tested on a fake clock in ``tests/rules/test_session_judge.py``."""

from __future__ import annotations

import contextlib
import pickle
import queue
from typing import Any

import pytest
from conftest import wait_until

from nbddp import WorkerError
from nbddp.plan import LaunchPlan
from nbddp.rules import task_referee
from nbddp.sessions.ranks import SessionRanks
from nbddp.wire.call import Call
from nbddp.wire.messages import (
    Close,
    Ended,
    ErrorReport,
    Failed,
    Interrupt,
    Joined,
    Received,
    Result,
    Task,
)

pytestmark = pytest.mark.unit

PLAN = LaunchPlan(2, "cpu", "gloo")


class FakeRanks:
    """Ranks whose events a test scripts: fed to the judge on the loop's thread, as a
    ``RankGroup`` feeds them; what the session does to them is logged in order."""

    nodes = ("localhost",)

    def __init__(self, *events: Any, exit_code: int = 0) -> None:
        self.pids = {0: 1000, 1: 1001}
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for event in events:
            self.events.put(event)
        self.log: list[Any] = []
        self._stopping = False
        self._exit_code = exit_code  # how each rank exits when it is sent Close

    def node_of(self, rank: int) -> str | None:
        return None

    def start(self) -> None:
        self.log.append("start")

    def serve(self, judge: Any) -> Any:
        try:
            while True:
                with contextlib.suppress(queue.Empty):
                    judge.event(self.events.get(timeout=0.01))
                verdict = judge.verdict()
                if verdict is not None:
                    return verdict
                if self._stopping:
                    return None
        finally:
            self.teardown()

    def stop(self) -> None:
        self._stopping = True

    def teardown(self) -> None:
        if "teardown" not in self.log:
            self.log.append("teardown")

    def send_all(self, message: Any) -> None:
        self.log.append(message)
        if isinstance(message, Close):  # each rank runs its exit work, then exits
            for rank in self.pids:
                self.events.put(Ended(rank, self._exit_code, ""))

    def send_task(self, task: Task, call: Call) -> None:
        self.log.append(task)

    def set_output(self, mode: Any, target: Any = None) -> None:
        pass

    def drain_output(self) -> None:
        pass

    def wake(self) -> None:
        pass


class Events:
    output = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


def joined(rank: int) -> Received:
    return Received(rank, Joined(rank), [])


def failed(rank: int) -> Received:
    report = ErrorReport("ValueError", "boom", "", None, 0.0, ("builtins.ValueError",), "builtins")
    return Received(rank, Failed(rank, report), [])


def test_the_start_returns_once_every_rank_joined_and_close_waits_for_their_exit():
    fake = FakeRanks(joined(0), joined(1))
    ranks = SessionRanks(PLAN, fake)
    ranks.start()
    assert ranks.alive and ranks.pids == {0: 1000, 1: 1001}
    ranks.close()
    assert not ranks.alive and ranks.ended == "closed"
    assert fake.log == ["start", Close(), "teardown"]


def test_a_rank_killed_in_its_exit_work_is_a_warning_at_close():
    ranks = SessionRanks(PLAN, FakeRanks(joined(0), joined(1), exit_code=-9))
    ranks.start()
    with pytest.warns(UserWarning, match="killed by signal 9.*while it ran its exit handlers"):
        ranks.close()


def test_a_rank_that_fails_before_joining_fails_the_start_with_it_and_ends_the_ranks():
    fake = FakeRanks(joined(0), failed(1))
    ranks = SessionRanks(PLAN, fake)
    with pytest.raises(WorkerError, match="rank 1 raised ValueError: boom"):
        ranks.start()
    assert not ranks.alive and "teardown" in fake.log


def test_a_task_that_loses_the_ranks_is_reported_only_once_they_are_torn_down(monkeypatch):
    monkeypatch.setattr(task_referee, "GRACE", 0.05)  # rank 1 is stuck for good
    fake = FakeRanks(joined(0), joined(1))
    ranks = SessionRanks(PLAN, fake)
    ranks.start()
    finished: list[Any] = []

    def finish(verdict: Any) -> None:
        fake.log.append("finished")
        finished.append(verdict)

    ranks.run_task("function", Call(b""), {}, PLAN, Events(), finish)  # type: ignore[arg-type]
    fake.events.put(failed(0))
    ranks._loop.join(30)
    assert [e for e in fake.log if isinstance(e, str)] == ["start", "teardown", "finished"]
    assert any(isinstance(e, Interrupt) for e in fake.log)  # the rank still in it was asked
    assert finished[0].stuck == (1,) and not ranks.alive
    assert "rank 1 did not return to idle" in (ranks.ended or "")


def test_a_task_every_rank_answered_is_finished_and_the_ranks_stay():
    fake = FakeRanks(joined(0), joined(1))
    ranks = SessionRanks(PLAN, fake)
    ranks.start()
    finished: list[Any] = []
    ranks.run_task("function", Call(b""), {}, PLAN, Events(), finished.append)  # type: ignore[arg-type]
    for rank in (0, 1):
        fake.events.put(Received(rank, Result(rank, pickle.dumps(rank * 7), False), []))
    task = next(e for e in fake.log if isinstance(e, Task))
    assert task.kind == "function"
    assert wait_until(lambda: bool(finished), 30)  # finished on the loop's thread
    assert finished[0].outcome.value == 0 and not finished[0].lost
    assert ranks.alive and "teardown" not in fake.log
    ranks.close()
