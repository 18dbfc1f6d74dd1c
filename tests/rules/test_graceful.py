"""A launch referee's graceful stop, on a fake clock (``rules/graceful.py``): the agreed step is
one past the largest count, and the run ends at once when it cannot be graceful: a rank that
never checked, had not started, did not answer, or outlived ``stop_grace``. The timeout asks
for a graceful stop first. A session task's referee follows the same rules, but "at once"
interrupts its ranks (they stay up, with their state). No process, no waiting."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from nbddp import LaunchTimeout
from nbddp.rules.graceful import ANSWER
from nbddp.rules.referee import Referee
from nbddp.rules.task_referee import GRACE, TaskReferee
from nbddp.wire.messages import AllJoined, Ended, GroupCount, Issued, Joined, Received, Result
from nbddp.wire.stopping import Checkpointed, Checks, StopAsked, StopAt, StoppedAt

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Events:
    output = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args))


def running(clock: Clock, world: int = 2, timeout: float | None = None, grace: float = 60.0):
    sent: list[Any] = []
    events = Events()
    judge = Referee(world, False, timeout, events, sent.append, clock=clock, stop_grace=grace)  # type: ignore[arg-type]
    for rank in range(world):
        judge.event(Received(rank, Joined(rank), []))
    assert sent == [AllJoined()]
    sent.clear()
    return judge, sent, events


def ends(judge: Referee, world: int = 2, value: Any = "value") -> None:
    for rank in range(world):
        judge.event(Received(rank, Result(rank, pickle.dumps(value), False), []))
        judge.event(Ended(rank, 0, ""))


def test_the_agreed_step_is_one_past_the_largest_count_and_the_value_is_the_result():
    clock = Clock()
    judge, sent, events = running(clock, world=3)
    judge.stop_gracefully("the Stop button")
    assert judge.verdict() is None and sent == [StopAsked()]
    assert ("stopping", ("the Stop button",)) in events.calls
    for rank, count in ((0, 41), (2, 43)):
        judge.event(Received(rank, Checks(rank, count), []))
    assert judge.verdict() is None and sent == [StopAsked()]  # rank 1 has not answered
    judge.event(Received(1, Checks(1, 42), []))
    judge.verdict()
    assert sent == [StopAsked(), StopAt(44)]
    judge.event(Received(0, StoppedAt(0, 43, "nbddp.progress"), []))
    judge.event(Received(0, Checkpointed(0, 43, "/ck/step-43", 0.1), []))
    ends(judge, world=3)
    outcome = judge.verdict()
    assert outcome.status == "stopped" and outcome.value == "value"
    assert "at step 43 (nbddp.progress)" in outcome.graceful
    assert "asked by the Stop button" in outcome.graceful and "/ck/step-43" in outcome.graceful


def stopped_after(*saves: Checkpointed) -> tuple[str, list]:
    """The warning of a 2-rank run stopped gracefully at step 23, after rank 0 said ``saves``;
    and the panel's calls."""
    judge, _, events = running(Clock())
    judge.stop_gracefully("run.stop(graceful=True)")
    judge.verdict()
    for rank in (0, 1):
        judge.event(Received(rank, Checks(rank, 22), []))
    judge.verdict()
    judge.event(Received(0, StoppedAt(0, 23, "the Hugging Face Trainer"), []))
    for save in saves:
        judge.event(Received(save.rank, save, []))
    ends(judge)
    outcome = judge.verdict()
    assert outcome.status == "stopped"
    return outcome.graceful, [call for call in events.calls if call[0] == "checkpointed"]


def test_the_stops_warning_names_a_trainers_own_checkpoint_and_how_it_resumes():
    hf = Checkpointed(0, 23, "/out/checkpoint-23", 0.0, by="the Hugging Face Trainer")
    said, panel = stopped_after(hf, hf._replace(rank=1, path="/elsewhere"))
    assert said.endswith(
        " The Hugging Face Trainer saved its own checkpoint of step 23 in /out/checkpoint-23 "
        "(trainer.train(resume_from_checkpoint=True) resumes it)."
    )
    assert "/elsewhere" not in said and "Nothing was saved" not in said
    assert panel == []  # the panel's checkpoint line is the run's own directory's

    ours = Checkpointed(0, 23, "/ck/step-23", 0.5)
    said, panel = stopped_after(hf, ours, Checkpointed(0, -1, "/acc", 0.0, by="Accelerate"))
    assert "Its checkpoint of step 23 is in /ck/step-23." in said and "checkpoint-23 (" in said
    assert " Accelerate saved its own checkpoint in /acc (accelerator.load_state(<" in said
    assert panel == [("checkpointed", (23, "/ck/step-23", 0.5, False))]


def test_the_stops_warning_says_nothing_was_saved_only_when_nothing_was():
    said, _ = stopped_after()
    assert "Nothing was saved after the stop" in said
    restored = Checkpointed(0, 7, "/ck/step-7", 0.1, restored=True)  # loaded, not saved
    assert "Nothing was saved after the stop" in stopped_after(restored)[0]


@pytest.mark.parametrize(
    ("why", "answers", "waited", "said"),
    [
        ("a rank never checked", {0: 5, 1: 0}, 0.0, "rank 1 had not checked"),
        ("a rank does not answer", {0: 5}, ANSWER, "rank(s) 1 did not answer"),
        ("the grace runs out", {0: 5, 1: 5}, 30.0, "not ended 30 s after"),
    ],
)
def test_a_stop_that_cannot_be_graceful_ends_the_run_at_once(why, answers, waited, said):
    clock = Clock()
    judge, _sent, _ = running(clock, grace=30.0)
    judge.stop_gracefully("run.stop(graceful=True)")
    judge.verdict()
    for rank, count in answers.items():
        judge.event(Received(rank, Checks(rank, count), []))
    clock.now += waited - 0.001
    if waited:
        assert judge.verdict() is None, why
        assert judge.deadline() == pytest.approx(clock.now + 0.001)
    clock.now += 0.001
    outcome = judge.verdict()
    assert outcome.status == "stopped" and outcome.graceful is None, why
    assert said in outcome.warning, why


def test_a_stop_before_every_rank_started_ends_at_once():
    clock = Clock()
    sent: list[Any] = []
    judge = Referee(2, False, None, Events(), sent.append, clock=clock)  # type: ignore[arg-type]
    judge.event(Received(0, Joined(0), []))  # rank 1 is still joining: fn has not started
    judge.stop_gracefully("the interrupt (■)")
    outcome = judge.verdict()
    assert outcome.status == "stopped" and "not every rank had started" in outcome.warning
    assert StopAsked() not in sent


def test_the_timeout_asks_for_a_graceful_stop_first_then_times_out_after_the_grace():
    clock = Clock()
    judge, sent, _ = running(clock, timeout=10.0, grace=5.0)
    clock.now += 10.0
    assert judge.verdict() is None and sent == [StopAsked()]
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 7), []))
    judge.verdict()
    assert sent[-1] == StopAt(8)
    assert judge.deadline() == pytest.approx(clock.now + 5.0)  # the grace, not the timeout
    clock.now += 5.0
    outcome = judge.verdict()
    assert isinstance(outcome.error, LaunchTimeout)
    assert "not ended 5 s after the graceful stop" in str(outcome.error)


def test_a_timeout_of_a_run_that_checks_ends_it_stopped_with_its_value():
    clock = Clock()
    judge, _sent, _ = running(clock, timeout=10.0)
    clock.now += 10.0
    judge.verdict()
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 3), []))
    judge.verdict()
    judge.event(Received(0, StoppedAt(0, 3, "nbddp.stopping()"), []))
    ends(judge)
    outcome = judge.verdict()
    assert outcome.status == "stopped" and outcome.value == "value"
    assert "asked by the timeout of 10 s" in outcome.graceful


def test_a_run_that_is_ending_is_stopped_at_once():
    clock = Clock()
    judge, sent, _ = running(clock)
    judge.event(Received(0, Result(0, pickle.dumps(1), False), []))
    judge.stop_gracefully("the interrupt (■)")
    outcome = judge.verdict()
    assert sent == []  # no step is left to agree on: a rank returned
    assert outcome.status == "stopped" and "already returned" in outcome.warning


def test_a_rank_that_never_checked_ends_the_run_before_the_others_answer():
    clock = Clock()
    judge, _, _ = running(clock, world=3)
    judge.stop_gracefully("the interrupt (■)")
    judge.verdict()
    judge.event(Received(2, Checks(2, 0), []))  # ranks 0 and 1 have not answered yet
    outcome = judge.verdict()
    assert outcome.status == "stopped" and "rank 2 had not checked" in outcome.warning


# -- a session task: the same agreement; its ranks stay up, so "at once" interrupts them ------


def task(clock: Clock, world: int = 2, timeout: float | None = None, grace: float = 60.0):
    """A session task's referee: what it sends to the ranks, and how often it interrupted."""
    sent: list[Any] = []
    interrupted: list[int] = []
    judge = TaskReferee(
        world,
        False,
        timeout,
        Events(),  # type: ignore[arg-type]
        lambda: interrupted.append(1),
        clock=clock,
        tell=sent.append,
        stop_grace=grace,
    )
    return judge, sent, interrupted


def answer(judge: TaskReferee, world: int = 2, value: Any = "value") -> None:
    """Every rank answers, its collectives in step with the others'."""
    for rank in range(world):
        judge.event(Received(rank, Issued(rank, (GroupCount("0", (0, 1), 3),)), []))
        judge.event(Received(rank, Result(rank, pickle.dumps(value), False), []))


def test_a_session_task_stops_at_the_agreed_step_with_its_value_and_keeps_its_ranks():
    clock = Clock()
    judge, sent, interrupted = task(clock)
    judge.stop_gracefully("run.stop(graceful=True)")
    assert judge.verdict() is None and sent == [StopAsked()]
    judge.event(Received(0, Checks(0, 12), []))
    judge.event(Received(1, Checks(1, 11), []))
    assert judge.verdict() is None and sent == [StopAsked(), StopAt(13)]
    judge.event(Received(0, StoppedAt(0, 13, "nbddp.stopping()"), []))
    answer(judge)
    verdict = judge.verdict()
    assert verdict is not None and not verdict.lost and interrupted == []
    assert verdict.outcome.status == "stopped" and verdict.outcome.value == "value"
    assert "at step 13 (nbddp.stopping())" in verdict.outcome.graceful


def test_a_session_task_that_never_checked_is_interrupted_at_once():
    clock = Clock()
    judge, _sent, interrupted = task(clock)
    judge.stop_gracefully("the Stop button")
    judge.verdict()
    judge.event(Received(1, Checks(1, 0), []))
    assert judge.verdict() is None and interrupted == [1]  # the ranks get GRACE to come back
    answer(judge)
    verdict = judge.verdict()
    assert verdict is not None and not verdict.lost
    assert verdict.outcome.status == "stopped" and verdict.outcome.graceful is None
    assert "rank 1 had not checked" in verdict.outcome.warning


def test_a_session_task_past_its_stop_grace_is_interrupted_and_stuck_ranks_are_named():
    clock = Clock()
    judge, _sent, interrupted = task(clock, grace=20.0)
    judge.stop_gracefully("the interrupt (■)")
    judge.verdict()
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 4), []))
    judge.verdict()
    clock.now += 20.0
    assert judge.verdict() is None and interrupted == [1]
    clock.now += GRACE
    verdict = judge.verdict()
    assert verdict is not None and verdict.stuck == (0, 1) and verdict.lost
    assert "not ended 20 s after" in verdict.outcome.warning


def test_a_session_tasks_timeout_stops_it_gracefully_when_it_checks():
    clock = Clock()
    judge, sent, interrupted = task(clock, timeout=10.0)
    clock.now += 10.0
    assert judge.verdict() is None and sent == [StopAsked()]
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 2), []))
    judge.verdict()
    assert judge.deadline() == pytest.approx(clock.now + 60.0)  # the grace, not the timeout
    judge.event(Received(0, StoppedAt(0, 3, "nbddp.progress"), []))
    answer(judge)
    verdict = judge.verdict()
    assert verdict is not None and interrupted == []
    assert verdict.outcome.status == "stopped" and verdict.outcome.value == "value"
    assert "asked by the timeout of 10 s" in verdict.outcome.graceful


def test_a_session_tasks_timeout_interrupts_a_task_that_never_checks():
    clock = Clock()
    judge, _sent, interrupted = task(clock, timeout=10.0)
    clock.now += 10.0
    judge.verdict()
    for rank in range(2):
        judge.event(Received(rank, Checks(rank, 0), []))
    assert judge.verdict() is None and interrupted == [1]
    answer(judge)
    error = judge.verdict().outcome.error
    assert isinstance(error, LaunchTimeout)
    assert "interrupted and kept their state (not gracefully: rank 0 had not checked" in str(error)


def test_a_graceful_stop_asked_as_the_task_ends_gives_its_value():
    """Every rank answered before the loop sent the ask: the task simply ended."""
    clock = Clock()
    judge, sent, interrupted = task(clock)
    answer(judge)
    judge.stop_gracefully("the Stop button")
    verdict = judge.verdict()
    assert verdict is not None and verdict.outcome.status == "succeeded"
    assert sent == [] and interrupted == []
